"""Each repository's environment (envs/repo_env.py), offline: `asyncrl tasks import --find-links`
installs what each repository declares (pyproject / setup.cfg / requirements, test extras) from
a directory holding the real inflection sdist and a local package with a runtime dependency of its
own, once per repository and version; the sandbox puts it on the path of the agent's commands and
of the scoring run. Without it the honest fix of a repository importing inflection fails; with it
the fix resolves and the empty patch does not. A repository whose dependency cannot be installed
is refused naming the instance and pip's reason, the rest imports, nothing half-written remains."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import tarfile

import pytest

from asyncrl.tasks import main as tasks_main
from envs import repo_env, repo_requirements, swebench
from envs.episode import Episode, EpisodeLimits
from envs.task_set import load_task_set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INFLECTION = os.path.join(ROOT, "tests", "data", "sdists", "inflection-0.5.1.tar.gz")

# namer: a runtime dependency (inflection) in pyproject; the bug leaves table names singular
NAMER_OK = """import inflection


def table_name(cls_name):
    return inflection.pluralize(inflection.underscore(cls_name))


def field_name(name):
    return inflection.underscore(name)
"""
NAMER_BUG = NAMER_OK.replace("return inflection.pluralize(inflection.underscore(cls_name))",
                             "return inflection.underscore(cls_name)")  # fmt: skip
NAMER_TESTS = """from namer import field_name, table_name


def test_table_name():
    assert table_name("BlogPost") == "blog_posts"


def test_person():
    assert table_name("Person") == "people"


def test_field_name():
    assert field_name("CreatedAt") == "created_at"
"""
# slugger: requirements.txt names slugkit, a local sdist that itself requires inflection
SLUGKIT_SRC = """import inflection


def slug(text):
    return inflection.parameterize(text)
"""
SLUGGER_OK = """from slugkit import slug


def url_for(title):
    return "/posts/" + slug(title)
"""
SLUGGER_BUG = SLUGGER_OK.replace('"/posts/"', '"/post/"')
SLUGGER_TESTS = """from slugger import url_for


def test_url_for():
    assert url_for("Hello World") == "/posts/hello-world"
"""


def git(cwd, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def diff(old: str, new: str, path: str, create: bool = False) -> str:
    """A git-style patch of one file (created when `create`)."""
    import difflib

    a = [] if create else old.splitlines(keepends=True)
    old_name = "/dev/null" if create else f"a/{path}"
    body = "".join(difflib.unified_diff(a, new.splitlines(keepends=True), old_name, f"b/{path}"))
    head = f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if create else "")
    return head + body


def make_repo(root, name: str, files: dict[str, str]) -> tuple[str, str]:
    """(git repository with one commit of `files`, its commit)."""
    repo = os.path.join(root, name)
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(repo, rel)), exist_ok=True)
        with open(os.path.join(repo, rel), "w") as f:
            f.write(text)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    return repo, git(repo, "rev-parse", "HEAD").strip()


def instance(iid: str, repo: str, path: str, commit: str, src: tuple[str, str, str], tests: tuple[str, str],
             f2p: list[str], p2p: list[str], version: str = "1.0") -> dict:  # fmt: skip
    rel, bug, ok = src
    return {
        "instance_id": iid,
        "repo": repo,
        "version": version,
        "repo_path": path,
        "base_commit": commit,
        "problem_statement": f"{rel} is wrong; fix it.",
        "patch": diff(bug, ok, rel),
        "test_patch": diff("", tests[1], tests[0], create=True),
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
        "split": "eval",
    }


def slugkit_sdist(dest: str) -> str:
    """A local source distribution whose package requires inflection at run time."""
    files = {
        "slugkit-0.1/setup.cfg": "[metadata]\nname = slugkit\nversion = 0.1\n\n[options]\n"
        "packages = slugkit\ninstall_requires =\n    inflection>=0.5\n",
        "slugkit-0.1/setup.py": "from setuptools import setup\nsetup()\n",
        "slugkit-0.1/slugkit/__init__.py": SLUGKIT_SRC,
        "slugkit-0.1/PKG-INFO": "Metadata-Version: 2.1\nName: slugkit\nVersion: 0.1\n",
    }
    path = os.path.join(dest, "slugkit-0.1.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """The instance file (namer twice: one environment for both; slugger; broken) and the
    find-links directory (the real inflection sdist, slugkit)."""
    root = str(tmp_path_factory.mktemp("repo-env-src"))
    links = os.path.join(root, "links")
    os.makedirs(links)
    assert os.path.isfile(INFLECTION)
    subprocess.run(["cp", INFLECTION, links], check=True)
    slugkit_sdist(links)
    pyproject = '[project]\nname = "namer"\nversion = "1.0"\ndependencies = ["inflection>=0.5"]\n'
    namer, c1 = make_repo(root, "namer", {"pyproject.toml": pyproject, "namer/__init__.py": NAMER_BUG})
    slugger, c2 = make_repo(
        root, "slugger", {"requirements.txt": "slugkit==0.1\n", "slugger.py": SLUGGER_BUG}
    )
    cfg = "[options]\ninstall_requires =\n    nosuchpkg-for-asyncrl>=1\n"
    broken, c3 = make_repo(root, "broken", {"setup.cfg": cfg, "broken.py": SLUGGER_BUG})
    t = "tests/test_namer.py"
    insts = [
        instance("acme__namer-1", "acme/namer", namer, c1, ("namer/__init__.py", NAMER_BUG, NAMER_OK),
                 (t, NAMER_TESTS), [f"{t}::test_table_name", f"{t}::test_person"], [f"{t}::test_field_name"]),
        instance("acme__namer-2", "acme/namer", namer, c1, ("namer/__init__.py", NAMER_BUG, NAMER_OK),
                 (t, NAMER_TESTS), [f"{t}::test_person"], [f"{t}::test_field_name"]),
        instance("acme__broken-1", "acme/broken", broken, c3, ("broken.py", SLUGGER_BUG, SLUGGER_OK),
                 ("test_broken.py", SLUGGER_TESTS.replace("slugger", "broken")),
                 ["test_broken.py::test_url_for"], []),
        instance("acme__slugger-1", "acme/slugger", slugger, c2, ("slugger.py", SLUGGER_BUG, SLUGGER_OK),
                 ("test_slugger.py", SLUGGER_TESTS), ["test_slugger.py::test_url_for"], [], version="2.0"),
    ]  # fmt: skip
    jsonl = os.path.join(root, "instances.jsonl")
    with open(jsonl, "w") as f:
        f.write("".join(json.dumps(i) + "\n" for i in insts))
    return jsonl, links, {i["instance_id"]: i for i in insts}


@pytest.fixture(scope="module")
def imported(src, tmp_path_factory):
    """`asyncrl tasks import --find-links`: (task set, stderr lines, instances)."""
    jsonl, links, insts = src
    out = str(tmp_path_factory.mktemp("repo-env-set") / "set")
    import contextlib

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = tasks_main(["import", jsonl, "--out", out, "--find-links", links])
    assert rc == 0, err.getvalue()
    return out, err.getvalue().splitlines(), insts


def test_requirements_are_read_not_run(tmp_path):
    """pyproject dependencies + test extras (the project's own extras followed), setup.cfg
    install_requires + extras, requirements files with `-r`; setup.py is never executed; pytest and
    the project itself are left out."""
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "Demo_Pkg"\ndependencies = ["inflection>=0.5", "toolz; python_version>=\'3\'"]\n'
        '[project.optional-dependencies]\ntest = ["pytest>=7", "demo-pkg[extra]", "more-itertools"]\n'
        'extra = ["attrs"]\ndocs = ["sphinx"]\n'
    )
    (tmp_path / "setup.cfg").write_text(
        "[options]\ninstall_requires =\n    six  # a comment\n"
        "[options.extras_require]\ntesting =\n    hypothesis\n"
    )
    (tmp_path / "requirements.txt").write_text("-r requirements-base.txt\n-e .\nidna==3.4 --hash=sha256:00\n")
    (tmp_path / "requirements-base.txt").write_text("# base\ncharset-normalizer\n--index-url http://x\n")
    (tmp_path / "requirements-docs.txt").write_text("furo\n")
    (tmp_path / "setup.py").write_text("open('ran', 'w').write('x')\n")
    got = repo_requirements.requirements(str(tmp_path))
    assert got == ["inflection>=0.5", "toolz; python_version>='3'", "more-itertools", "attrs", "six",
                   "hypothesis", "charset-normalizer", "idna==3.4"]  # fmt: skip
    assert not (tmp_path / "ran").exists()
    (tmp_path / "pyproject.toml").write_text("[project\n")
    with pytest.raises(repo_env.EnvError, match="pyproject.toml does not parse"):
        repo_requirements.requirements(str(tmp_path))


def test_import_builds_one_env_per_repository_and_version(imported):
    out, err, insts = imported
    tasks = {t.task_id: t for t in load_task_set(out)}
    assert sorted(tasks) == ["acme__namer-1", "acme__namer-2", "acme__slugger-1"]
    # the two namer instances share one environment; slugger has its own
    envs_dir = os.path.join(out, "envs")
    assert sorted(os.listdir(envs_dir)) == ["acme__namer-1.0", "acme__slugger-2.0"]
    assert (
        tasks["acme__namer-1"].env_dir
        == tasks["acme__namer-2"].env_dir
        == os.path.join(envs_dir, "acme__namer-1.0")
    )
    namer = repo_env.read_manifest(os.path.join(envs_dir, "acme__namer-1.0"))
    assert namer["requirements"] == ["inflection>=0.5"]
    assert [d["name"] for d in namer["installed"]] == ["inflection"]
    assert namer["repo"] == "acme/namer" and namer["version"] == "1.0"
    slugger = repo_env.read_manifest(os.path.join(envs_dir, "acme__slugger-2.0"))
    # a runtime dependency of a dependency: slugkit brings inflection
    assert sorted(d["name"] for d in slugger["installed"]) == ["inflection", "slugkit"]
    assert os.path.isfile(os.path.join(envs_dir, "acme__slugger-2.0", "site", "slugkit", "__init__.py"))
    # the import says what it installed, on stderr and in the set's manifest
    assert "environment acme__slugger-2.0: inflection==0.5.1, slugkit==0.1" in err, err
    report = json.loads(open(os.path.join(out, "manifest.json")).read())["report"]["environments"]
    assert report["acme__namer-1.0"] == {"installed": ["inflection==0.5.1"]}
    assert report["acme__broken-1.0"]["error"].startswith("environment acme__broken-1.0 cannot be built: ")
    # tasks.jsonl keeps the environment relative to the set (the set can move)
    with open(os.path.join(out, "tasks.jsonl")) as f:
        assert {json.loads(x)["env_dir"] for x in f} == {"envs/acme__namer-1.0", "envs/acme__slugger-2.0"}


def test_an_instance_whose_environment_cannot_be_built_is_refused(imported):
    out, err, insts = imported
    skipped = [x for x in err if x.startswith("skipped")]
    assert len(skipped) == 1, err
    line = skipped[0]
    assert line.startswith(
        "skipped line 3: acme__broken-1: environment acme__broken-1.0 cannot be built: "
    ), line
    assert "nosuchpkg-for-asyncrl" in line and "No matching distribution" in line, line
    assert "imported 3 of 4 instances" in "\n".join(err)
    man = json.loads(open(os.path.join(out, "manifest.json")).read())["report"]["skipped"]
    assert [(s["instance"], s["field"]) for s in man] == [("acme__broken-1", "environment")]
    # nothing half-written: no snapshot of it, no environment, no build directory left
    assert "acme__broken-1" not in os.listdir(os.path.join(out, "repos"))
    assert not [x for x in os.listdir(os.path.join(out, "envs")) if x.startswith(".") or "broken" in x]


def test_no_envs_imports_without_them(src, tmp_path, capsys):
    jsonl, links, insts = src
    assert tasks_main(["import", jsonl, "--out", str(tmp_path / "set"), "--no-envs"]) == 0
    tasks = load_task_set(str(tmp_path / "set"))
    assert len(tasks) == 4 and all(t.env_dir is None for t in tasks)
    assert not (tmp_path / "set" / "envs").exists()


def test_honest_fix_needs_the_environment_and_resolves_with_it(imported):
    """The same gold patch: without the environment every test fails (inflection is not there),
    with it the instance resolves; the empty patch does not."""
    out, err, insts = imported
    tasks = {t.task_id: t for t in load_task_set(out)}
    for iid in ("acme__namer-1", "acme__slugger-1"):
        task, gold = tasks[iid], insts[iid]["patch"]
        bare = swebench.evaluate_patch(dataclasses.replace(task, env_dir=None), gold)
        assert bare["patch_applied"] and not bare["resolved"] and bare["reward"] == 0.0, bare
        ok = swebench.evaluate_patch(task, gold)
        assert ok["resolved"] and ok["reward"] == 1.0, ok
        empty = swebench.evaluate_patch(task, "")
        assert not empty["resolved"] and empty["reward"] == 0.0
    # the untouched repository: the fail-to-pass tests fail, the pass-to-pass one passes (report mode)
    ep = Episode(tasks["acme__namer-1"], EpisodeLimits())
    try:
        ep.reset()
        ep.step("```bash\nsubmit\n```")
        r = ep.score()
    finally:
        ep.close()
    assert not r.tampered and not r.infra_error, r
    t = "tests/test_namer.py::test_"
    assert r.tests == {f"{t}table_name": False, f"{t}person": False, f"{t}field_name": True}


def test_the_agents_commands_see_the_environment_read_only(imported):
    out, err, insts = imported
    task = next(t for t in load_task_set(out) if t.task_id == "acme__slugger-1")
    ep = Episode(task, EpisodeLimits())
    try:
        ep.reset()
        r = ep.step(
            '```bash\npython -c "import slugkit, inflection; '
            "print(slugkit.slug('A B'), inflection.__file__)\"\n```"
        )
        out_text = r.observation
        assert "<returncode>0</returncode>" in out_text and "a-b" in out_text, out_text
        site = out_text.split("a-b ", 1)[1].split("/inflection/__init__.py", 1)[0].strip()
        assert site.endswith("/site") and "/envs/" in site, out_text
        w = ep.step(f"```bash\ntouch {site}/inflection/x.py && echo WROTE\n```").observation
        assert "WROTE" not in w and "<returncode>0</returncode>" not in w, w
        # the agent's own pytest run of a test it wrote sees it too (the hidden tests are not there)
        mine = (
            "from slugger import url_for\n\n\ndef test_mine():\n    assert url_for('A B') == '/posts/a-b'\n"
        )
        t = ep.step(
            f"```bash\ncat > test_mine.py <<'EOF'\n{mine}EOF\npython -m pytest -q test_mine.py\n```"
        ).observation
        assert "1 failed" in t and "/post/a-b" in t and "ModuleNotFoundError" not in t, t
    finally:
        ep.close()


def test_a_broken_environment_is_an_infrastructure_error(imported, tmp_path):
    """An env_dir that is not a built environment: the workspace is not made (infra, not the
    policy's doing)."""
    out, err, insts = imported
    task = next(t for t in load_task_set(out) if t.task_id == "acme__namer-1")
    bad = tmp_path / "envs" / "nothing"
    bad.mkdir(parents=True)
    ep = Episode(dataclasses.replace(task, env_dir=str(bad)), EpisodeLimits())
    try:
        ep.reset()
        assert ep.done
        r = ep.score()
    finally:
        ep.close()
    assert r.termination == "sandbox_error" and r.infra_error == "workspace", r
    assert "not a built environment" in r.detail, r.detail
    # one built for another python: refused with the reason, not run with the wrong packages
    other = tmp_path / "envs" / "other"
    subprocess.run(["cp", "-r", task.env_dir, str(other)], check=True)
    man = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**man, "python": "2.7"}))
    ep = Episode(dataclasses.replace(task, env_dir=str(other)), EpisodeLimits())
    try:
        ep.reset()
        r = ep.score()
    finally:
        ep.close()
    assert r.infra_error == "workspace" and "was built for python 2.7" in r.detail, r.detail


def test_build_sdist_installs_the_packages_declared_dependencies(src, tmp_path, capsys):
    """`asyncrl tasks build --sdist --find-links`: a package whose source imports inflection gets
    its environment, so its tests pass on the original and its bugs are found; without environments
    no test passes there and the package is left out."""
    from bench.tiny_package import TINY_SRC, write_sdist

    jsonl, links, insts = src
    extra = {
        "tinypkg-0.1/setup.cfg": "[options]\ninstall_requires =\n    inflection\n",
        "tinypkg-0.1/tinypkg/__init__.py": "import inflection\n" + TINY_SRC,
    }
    sdist = write_sdist(str(tmp_path), extra=extra)
    out = tmp_path / "set"
    args = ["build", "--out", str(out), "--sdist", sdist, "--per-package", "1", "--test-timeout", "60"]
    assert tasks_main([*args, "--find-links", links]) == 0, capsys.readouterr()
    (task,) = load_task_set(str(out))
    assert task.env_dir == str(out / "envs" / "tinypkg-0.1") and task.fail_to_pass
    man = repo_env.read_manifest(task.env_dir)
    assert man["package"] == "tinypkg-0.1" and [d["name"] for d in man["installed"]] == ["inflection"]
    capsys.readouterr()
    assert tasks_main([*args[:2], str(tmp_path / "bare"), *args[3:], "--no-envs"]) == 1
    assert "tinypkg-0.1: skipped, no test passes on the original" in capsys.readouterr().out


def test_a_workspace_module_cannot_stand_in_for_a_dependency(imported):
    """A top-level `inflection.py` in the patch answering the tests' inputs: the scoring run finds the
    environment's inflection first (only the task's own modules come from the copy before it)."""
    out, err, insts = imported
    task = next(t for t in load_task_set(out) if t.task_id == "acme__namer-1")
    fake = (
        "def underscore(s):\n    return {'BlogPost': 'blog_posts', 'Person': 'people', "
        "'CreatedAt': 'created_at'}[s]\n\n\ndef pluralize(s):\n    return s\n"
    )
    patch = diff("", fake, "inflection.py", create=True)
    got = swebench.evaluate_patch(task, patch)
    assert got["patch_applied"] and not got["resolved"], got
    assert got["tests_status"]["FAIL_TO_PASS"]["success"] == [], got
    # where no installed copy exists, the copy's module is the one found: the stand-in then works
    assert swebench.evaluate_patch(dataclasses.replace(task, env_dir=None), patch)["resolved"]


def test_worker_refuses_an_environment_outside_its_task_set(imported, tmp_path):
    from bus.events import Task
    from policy import CharTokenizer
    from rollout_worker.episodes import EpisodeRunner
    from rollout_worker.torch_engine import TorchEngine
    from tests.helpers.agentic import CFG

    out, err, insts = imported
    task = next(t for t in load_task_set(out) if t.task_id == "acme__namer-1")
    tok = CharTokenizer.default()
    eng = TorchEngine(CFG, slots=1, max_len=2048, eos_id=tok.eos_id)
    runner = EpisodeRunner(eng, tok, task_set=out)

    def spec(t):
        return Task(
            task_id="t", env="swe", prompt="p", spec={"episode": t.to_dict(), "limits": {}}, sampling={}
        )

    assert runner.parse(spec(task))[0].env_dir == task.env_dir  # its own set: fine
    other = tmp_path / "envs" / "acme__namer-1.0"
    other.mkdir(parents=True)
    with pytest.raises(ValueError, match="repository environment .* is outside this worker's task set"):
        runner.parse(spec(dataclasses.replace(task, env_dir=str(other))))


def test_bad_declarations_are_refused_with_the_reason(src, tmp_path):
    jsonl, links, insts = src
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = "inflection"\n')
    builder = repo_env.Builder(str(tmp_path / "envs"), links)
    with pytest.raises(repo_env.EnvError, match="env-a cannot be built: pyproject.toml: .*must be a list"):
        builder.for_repo("env-a", str(tmp_path / "r"))
    with pytest.raises(repo_env.EnvError, match="must be a list"):  # the same outcome, not built again
        builder.for_repo("env-a", str(tmp_path / "other"))
    (tmp_path / "r" / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["inflection @ https://example.invalid/i.whl"]\n'
    )
    with pytest.raises(repo_env.EnvError, match="is a direct URL; offline, packages come from"):
        builder.for_repo("env-b", str(tmp_path / "r"))
    # a repository declaring nothing gets no environment, and no pip run
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "setup.py").write_text(
        "from setuptools import setup\nsetup(install_requires=['x'])\n"
    )
    assert builder.for_repo("env-c", str(tmp_path / "empty")) is None
    assert not (tmp_path / "envs").exists() or os.listdir(tmp_path / "envs") == []


# Run as a user who is not root: build an environment from the find-links directory, then play
# an episode that needs it in the rootless sandbox (every mount read-only but the workspace).
ROOTLESS = r"""
import json, sys
from envs import repo_env
from envs.episode import Episode, EpisodeLimits, EpisodeTask
from envs.workspace import LocalBackend

base, links = sys.argv[1], sys.argv[2]
env_dir = repo_env.build(base + "/envs", "namer", ["inflection"], links)
TESTS = "from namer import plural\n\n\ndef test_plural():\n    assert plural('person') == 'people'\n"
BUG = "import inflection\n\n\ndef plural(w):\n    return w\n"
task = EpisodeTask("t-namer", "test", "train", "Fix namer.py.", {"namer.py": BUG, "test_namer.py": TESTS},
                   {"test_namer.py": TESTS}, "pytest", ["test_namer.py"], ["test_namer.py::test_plural"], [],
                   env_dir=env_dir)
ep = Episode(task, EpisodeLimits(), backend=LocalBackend(base + "/episodes"))
ep.reset()
bash = lambda c: f"```bash\n{c}\n```"
where = "python -c 'import inflection; print(inflection.__file__)'"
out = {"import": ep.step(bash(where)).observation}
out["write"] = ep.step(bash(f"touch $(dirname $({where}))/x")).observation
fix = "import inflection\\n\\n\\ndef plural(w):\\n    return inflection.pluralize(w)\\n"
ep.step(bash(f"printf '{fix}' > namer.py"))
ep.step(bash("submit"))
r = ep.score()
out["honest"] = [r.reward, r.resolved, r.detail]
ep.close()
print(json.dumps(out))
"""


def test_environment_in_the_rootless_sandbox(src, tmp_path):
    from tests.helpers.unprivileged import unprivileged

    user = unprivileged()
    if isinstance(user, str):
        pytest.skip(user)
    try:
        jsonl, links, insts = src
        mine = user.base / "links"
        subprocess.run(["cp", "-r", links, str(mine)], check=True)
        subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(mine)], check=True)
        r = user.run([user.python, "-c", ROOTLESS, str(user.base), str(mine)], timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert "<returncode>0</returncode>" in out["import"] and "/envs/namer-" in out["import"], out
        assert "Read-only file system" in out["write"], out
        assert out["honest"][:2] == [1.0, True], out
    finally:
        user.close()


def test_mount_copies_once_read_only_and_reaps_dead_copies(imported, tmp_path):
    out, err, insts = imported
    env_dir = os.path.join(out, "envs", "acme__namer-1.0")
    root = tmp_path / "root"
    root.mkdir()
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()
    half = root / "envs" / f".copy-{dead}-x"
    half.mkdir(parents=True)
    site = repo_env.mount(str(root), env_dir)
    assert not half.exists()  # its process is gone: a half-made copy
    assert site.startswith(str(root / "envs" / "acme__namer-1.0-")) and site.endswith("/site")
    init = os.path.join(site, "inflection", "__init__.py")
    assert os.stat(init).st_mode & 0o777 == 0o644 and os.stat(site).st_mode & 0o777 == 0o755
    before = os.stat(init).st_mtime_ns
    assert repo_env.mount(str(root), env_dir) == site and os.stat(init).st_mtime_ns == before
    assert sorted(os.listdir(root / "envs")) == [os.path.basename(os.path.dirname(site))]


def test_a_set_whose_environment_is_gone_is_refused_on_load(imported, tmp_path):
    out, err, insts = imported
    moved = tmp_path / "set"
    subprocess.run(["cp", "-r", out, str(moved)], check=True)
    assert {t.env_dir for t in load_task_set(str(moved))} == {
        str(moved / "envs" / "acme__namer-1.0"),
        str(moved / "envs" / "acme__slugger-2.0"),
    }  # relative to the set: it moves with it
    subprocess.run(["rm", "-r", str(moved / "envs" / "acme__slugger-2.0")], check=True)
    with pytest.raises(ValueError, match="missing repository environment .*acme__slugger-2.0"):
        load_task_set(str(moved))
