"""The container workspace backend (envs/workspace_docker.py): the command lines it builds, the
wrapper that runs inside the container (run here with bash, exactly as `docker exec` would run it),
the tars it copies in and out; whole episodes of an imported SWE-bench-format set through the real
backend against a stand-in `docker` executable (below: each container a directory tree here),
scored as the local backend scores them; and a whole episode in a real container where `docker
info` works."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from envs import repo_env, swebench
from envs import workspace_docker as wd
from envs.episode import Episode, EpisodeLimits, EpisodeResult, EpisodeTask
from envs.sandbox import BashLimits
from envs.task_set import load_task_set
from envs.workspace import LocalBackend
from tests.helpers.swe_sets import fix_commands, imported_set

B = wd.DockerBackend(image="img:1", user="1000:1001", pids=99, memory_mb=512, cpus=0.5, tmp_mb=32)
TESTS = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def task(**kw) -> EpisodeTask:
    return EpisodeTask(
        **{
            **dict(
                task_id="t-add",
                family="test",
                split="train",
                instruction="Fix calc.py.",
                files={"calc.py": "def add(a, b):\n    return a - b\n", "tests/test_calc.py": TESTS},
                hidden_tests={"tests/test_calc.py": TESTS},
                runner="mini",
                test_paths=["tests/test_calc.py"],
                fail_to_pass=["tests/test_calc.py::test_add"],
                pass_to_pass=[],
            ),
            **kw,
        }
    )


def test_create_exec_copy_and_rm_command_lines():
    argv = wd.create_argv(B, "ep1", "img:1")
    assert argv[:4] == ["docker", "create", "--name", "ep1"] and argv[-3:] == ["sleep", "img:1", "infinity"]
    opts = dict(zip(argv[4:-2:2], argv[5:-2:2]))
    assert opts["--network"] == "none" and opts["--pids-limit"] == "99" and opts["--memory"] == "512m"
    assert opts["--memory-swap"] == "512m" and opts["--cpus"] == "0.5" and opts["--cap-drop"] == "ALL"
    assert opts["--tmpfs"] == "/tmp:rw,nosuid,nodev,size=32m" and opts["--entrypoint"] == "sleep"
    assert wd.copy_in_argv(B, "ep1") == ["docker", "cp", "-a", "-", "ep1:/"]
    assert wd.rm_argv(B, "ep1") == ["docker", "rm", "-f", "-v", "ep1"]
    assert wd.kill_argv(B, "ep1") == ["docker", "kill", "ep1"]
    assert wd.copy_out_argv(B, "ep1", "/workspace") == ["docker", "cp", "ep1:/workspace", "-"]
    assert wd.start_argv(B, "ep1") == ["docker", "start", "ep1"]
    lim = BashLimits(wall_s=3.0, cpu_s=4, memory_mb=256, file_mb=2, open_files=64, keep_bytes=100)
    ex = wd.exec_argv(B, "ep1", "/workspace", "echo hi", lim)
    assert ex[:6] == ["docker", "exec", "-u", "1000:1001", "-w", "/workspace"]
    assert f"PATH={wd.TOOLS}:/usr/local/bin:/usr/bin:/bin" in ex and ex.index("ep1") < ex.index("bash")
    assert ex[-4:] == ["asyncrl-exec", "100", "3.0s", "echo hi"]  # the command is one argv item
    assert "ulimit -c 0 -t 4 -v 262144 -f 2048 -n 64" in ex[-5]
    assert wd.exec_argv(B, "ep1", "/w", "x", lim, user="0")[3] == "0"


def wrapper(command: str, lim: BashLimits) -> subprocess.CompletedProcess:
    """What `docker exec` runs in the container, run here by bash."""
    argv = wd.exec_argv(B, "ep1", "/", command, lim)
    return subprocess.run(argv[argv.index("bash") :], capture_output=True, timeout=60, cwd="/tmp")


def test_the_wrapper_caps_output_kills_at_the_wall_limit_and_keeps_exit_codes():
    lim = BashLimits(wall_s=1.0, cpu_s=5, file_mb=1, keep_bytes=50)
    r = wrapper("echo out; echo err >&2; exit 3", lim)
    assert r.returncode == 3 and r.stdout == b"out\nerr\n"
    assert wd.exec_reason(r.returncode, False, 0.1, lim) == "exit code 3"
    r = wrapper("seq 1 100000", lim)  # long output: head and tail only
    assert r.returncode == 0 and r.stdout.startswith(b"1\n2\n") and r.stdout.endswith(b"99999\n100000\n")
    assert b"bytes omitted" in r.stdout and len(r.stdout) < 200
    r = wrapper("yes", lim)  # endless output: the file size limit stops it
    assert (
        wd.exec_reason(r.returncode, False, 0.5, lim) == "output limit (1 MB) exceeded"
        and len(r.stdout) < 200
    )
    r = wrapper("sleep 30 & sleep 30", lim)  # the whole process group dies at the wall limit
    assert r.returncode == 137 and wd.exec_reason(137, False, 1.2, lim) == "wall timeout after 1.0s"
    assert wd.exec_reason(137, False, 0.2, lim) == "killed (out of memory)"
    assert wd.exec_reason(0, True, 99.0, lim) == "wall timeout after 1.0s"
    assert wd.exec_reason(0, False, 0.1, lim) == "ok"


def test_tar_carries_paths_modes_and_owners_and_refuses_escapes():
    data = wd.tar_of(
        {
            "/workspace": (None, 0o755, 1000, 1001),
            "/workspace/pkg/a.py": (b"x = 1\n", 0o644, 1000, 1001),
            f"{wd.TOOLS}/view": (b"#!/bin/sh\n", 0o755, 0, 0),
        }
    )
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        m = {i.name: i for i in tar.getmembers()}
        assert tar.extractfile("workspace/pkg/a.py").read() == b"x = 1\n"
    assert (m["workspace/pkg/a.py"].uid, m["workspace/pkg/a.py"].gid, m["workspace/pkg/a.py"].mode) == (
        1000,
        1001,
        0o644,
    )
    assert m["workspace/pkg"].isdir() and m["workspace/pkg"].uid == 1000
    assert "opt" not in m  # a top-level directory of the image keeps its owner
    assert m["workspace"].isdir() and m["workspace"].uid == 1000
    assert m["opt/asyncrl-tools/view"].mode == 0o755 and m["opt/asyncrl-tools/view"].uid == 0
    with pytest.raises(ValueError, match="leaves the container root"):
        wd.tar_of({"/workspace/../etc/passwd": (b"", 0o644, 0, 0)})


def test_mounts_the_python_path_and_the_setup_command():
    argv = wd.create_argv(B, "ep1", "img:1", [("/sets/s/envs/k/site", wd.env_target(B))])
    at = argv.index("--mount")
    assert argv[at + 1] == f"type=bind,source=/sets/s/envs/k/site,target={wd.TOOLS}/env,readonly"
    assert at < argv.index("--entrypoint") and argv[-2:] == ["img:1", "infinity"]
    with pytest.raises(ValueError, match="without ','"):
        wd.create_argv(B, "ep1", "img:1", [("/a,b", "/x")])
    lim = BashLimits()
    ex = wd.exec_argv(B, "ep1", "/w", "x", lim, pythonpath=[wd.site_target(B), wd.env_target(B)])
    assert f"PYTHONPATH={wd.TOOLS}/site:{wd.TOOLS}/env" in ex
    assert not any(a.startswith("PYTHONPATH=") for a in wd.exec_argv(B, "ep1", "/w", "x", lim))
    mine = dataclasses.replace(B, tools="/srv/t")
    assert "PATH=/srv/t:/usr/local/bin:/usr/bin:/bin" in wd.exec_argv(mine, "ep1", "/w", "x", lim)
    assert wd.env_target(mine) == "/srv/t/env" and wd.site_target(mine) == "/srv/t/site"
    assert wd.setup_command("/w", False, None) == ""


def test_the_setup_command_empties_the_workdir_and_probes_the_python(tmp_path):
    """Run here by bash, as `docker exec -u 0` runs it in a new container."""
    work = tmp_path / "work w"
    (work / "pkg").mkdir(parents=True)
    (work / "pkg" / "old.py").write_text("x = 1\n")
    cmd = wd.setup_command(str(work), True, sys.executable)
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not work.exists(), r.stderr
    assert wd.parse_probe(r.stdout) == (f"{sys.version_info[0]}.{sys.version_info[1]}", True)
    assert wd.parse_probe("no such file\n") is None
    assert wd.parse_probe("asyncrl-probe 3.9 0\n") == ("3.9", False)


def test_trees_go_in_with_their_links_and_come_out_safely(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("a = 1\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o700)
    os.symlink("pkg/a.py", src / "alias.py")
    os.mkfifo(src / "pipe")
    data = wd.tar_of(
        {"/w/pkg/a.py": (b"a = 2\n", 0o644, 1000, 1000)},  # an entry goes over the tree's file
        [(str(src), "/w", 1000, 1000, False), (str(src), "/t/site", 0, 0, True)],
    )
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        m = {i.name: i for i in tar.getmembers()}
        last = [i for i in tar.getmembers() if i.name == "w/pkg/a.py"][-1]
        assert tar.extractfile(last).read() == b"a = 2\n"
    assert m["w/alias.py"].issym() and m["w/alias.py"].linkname == "pkg/a.py"
    assert "w/pipe" not in m and m["w"].uid == 1000 and m["w/pkg"].isdir()
    assert m["w/run.sh"].mode == 0o700 and m["t/site/run.sh"].mode == 0o755  # read-only: 0755 / 0644
    assert m["t/site/pkg/a.py"].mode == 0o644 and m["t/site/pkg/a.py"].uid == 0

    def out_tar(add) -> io.BytesIO:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            add(tar)
        buf.seek(0)
        return buf

    os.link(src / "pkg" / "a.py", src / "hard.py")
    dest = tmp_path / "out"
    wd.untar_into(out_tar(lambda t: t.add(src, arcname="workspace")), str(dest))
    assert (dest / "pkg" / "a.py").read_text() == "a = 1\n" and (dest / "hard.py").read_text() == "a = 1\n"
    assert os.readlink(dest / "alias.py") == "pkg/a.py" and not (dest / "pipe").exists()
    kept = tmp_path / "kept"
    wd.untar_into(out_tar(lambda t: t.add(src, arcname="w")), str(kept), keep=lambda r: r.endswith(".sh"))
    assert sorted(os.listdir(kept)) == ["run.sh"]
    with pytest.raises(wd.TreeTooBig, match="more than 2 files"):
        wd.untar_into(out_tar(lambda t: t.add(src, arcname="w")), str(tmp_path / "x"), max_files=2)
    with pytest.raises(wd.TreeTooBig, match="over 0 MB"):
        wd.untar_into(out_tar(lambda t: t.add(src, arcname="w")), str(tmp_path / "y"), max_bytes=3)

    def escape(tar):
        info = tarfile.TarInfo("w/../../etc/x")
        tar.addfile(info, io.BytesIO(b""))

    with pytest.raises(ValueError, match="leaves the tree"):
        wd.untar_into(out_tar(escape), str(tmp_path / "z"))

    def through_link(tar):  # a file under a symlinked directory is written in a real directory
        link = tarfile.TarInfo("w/up")
        link.type, link.linkname = tarfile.SYMTYPE, str(tmp_path / "victim")
        tar.addfile(link)
        f = tarfile.TarInfo("w/up/x.py")
        f.size = 2
        tar.addfile(f, io.BytesIO(b"x\n"))

    (tmp_path / "victim").mkdir()
    wd.untar_into(out_tar(through_link), str(tmp_path / "v"))
    assert (tmp_path / "v" / "up" / "x.py").read_text() == "x\n" and not os.listdir(tmp_path / "victim")


def test_a_workspace_that_cannot_be_made_says_why():
    ws = wd.DockerBackend(docker="/nonexistent/docker").create(task(), EpisodeLimits())
    assert ws.error.startswith("workspace setup failed") and "create" in ws.error
    ws.close()  # nothing was created: nothing to remove
    ws = wd.DockerBackend(docker="/nonexistent/docker").create(
        task(env_dir="/nonexistent/env"), EpisodeLimits()
    )
    assert ws.error.startswith("workspace setup failed") and "not a built environment" in ws.error
    ws.close()


# -- a stand-in for the docker CLI -------------------------------------------------------------------
# Just the subcommands the backend uses, each container a directory tree (its root) under STATE:
# `create` copies the image's tree (STATE/images/<image>, else nothing) and each --mount's source
# (a read-only bind mount, as a copy); `cp` extracts a tar at the root or writes one of a path;
# `exec` runs the command here with the container's view of PREFIX (every path the backend uses in
# the container lies under it: workdir, tools, mounts) renamed into place for that command, with
# only the environment -e gives. Not emulated: users (-u: the command runs as the caller), the
# resource limits of `create`, the network, and processes outliving their command (`kill` marks the
# container stopped). What runs is the backend's own code: its argv, its tars, its exec wrapper.
STANDIN = r"""#!@PYTHON@
import json, os, shutil, subprocess, sys, tarfile
STATE, PREFIX = @STATE@, @PREFIX@


def box(name):
    return os.path.join(STATE, "c", name)


def inside(name, path):
    return os.path.join(box(name), "root", path.lstrip("/"))


def meta(name, **change):
    p = os.path.join(box(name), "meta.json")
    if not os.path.exists(p):
        sys.exit(f"Error: No such container: {name}")
    with open(p) as f:
        m = json.load(f)
    if change:
        m.update(change)
        with open(p, "w") as f:
            json.dump(m, f)
    return m


def main(cmd, args):
    if cmd == "create":
        opts, mounts, i = {}, [], 0
        while args[i].startswith("--"):
            if args[i] == "--mount":
                mounts.append(dict(kv.partition("=")[::2] for kv in args[i + 1].split(",")))
            opts[args[i]] = args[i + 1]
            i += 2
        name, image = opts["--name"], args[i]
        os.makedirs(os.path.join(STATE, "c"), exist_ok=True)
        os.mkdir(box(name))
        tree = os.path.join(STATE, "images", image.replace("/", "_").replace(":", "_"))
        if os.path.isdir(tree):
            shutil.copytree(tree, inside(name, "/"), symlinks=True)
        os.makedirs(inside(name, "/"), exist_ok=True)
        for m in mounts:
            shutil.copytree(m["source"], inside(name, m["target"]), symlinks=True)
        with open(os.path.join(box(name), "meta.json"), "w") as f:
            json.dump({"image": image, "running": False, "mounts": mounts}, f)
    elif cmd == "start":
        meta(args[0], running=True)
    elif cmd == "kill":
        if not meta(args[0])["running"]:
            sys.exit(f"Error: container {args[0]} is not running")
        meta(args[0], running=False)
    elif cmd == "rm":
        shutil.rmtree(box(args[-1]), ignore_errors=True)
    elif cmd == "cp":
        src, dst = [a for a in args if a != "-a"]
        if src == "-":
            name = dst.split(":", 1)[0]
            meta(name)
            with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
                tar.extractall(inside(name, "/"), filter="tar")
        else:
            name, path = src.split(":", 1)
            meta(name)
            if not os.path.lexists(inside(name, path)):
                sys.exit(f"Error: Could not find the file {path} in container {name}")
            with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
                tar.add(inside(name, path), arcname=os.path.basename(path))
    elif cmd == "exec":
        env, workdir, i = {}, "/", 0
        while args[i].startswith("-"):
            if args[i] == "-e":
                k, _, v = args[i + 1].partition("=")
                env[k] = v
            elif args[i] == "-w":
                workdir = args[i + 1]
            i += 2
        name, argv = args[i], args[i + 1 :]
        if not meta(name)["running"]:
            sys.exit(f"Error: container {name} is not running")
        view = inside(name, PREFIX)
        os.makedirs(view, exist_ok=True)
        os.rename(view, PREFIX)
        try:
            rc = subprocess.run(argv, cwd=workdir, env=env).returncode
        finally:
            os.rename(PREFIX, view)
        sys.exit(rc)
    else:
        sys.exit(f"stand-in docker: {cmd} is not implemented")


main(sys.argv[1], sys.argv[2:])
"""


@dataclasses.dataclass
class StandIn:
    backend: wd.DockerBackend
    state: str
    prefix: str

    def image(self, name: str, files: dict[str, str]) -> None:
        """An image whose workdir holds `files`."""
        root = os.path.join(self.state, "images", name.replace("/", "_").replace(":", "_"))
        for rel, text in files.items():
            p = os.path.join(root, self.backend.workdir.lstrip("/"), rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write(text)

    def containers(self) -> list[str]:
        return sorted(os.listdir(os.path.join(self.state, "c")))


def stand_in(tmp_path, python: str = sys.executable) -> StandIn:
    state, prefix = str(tmp_path / "docker-state"), str(tmp_path / "box")  # prefix: not made here
    script = tmp_path / "docker"
    script.write_text(
        STANDIN.replace("@PYTHON@", sys.executable)
        .replace("@STATE@", repr(state))
        .replace("@PREFIX@", repr(prefix))
    )
    script.chmod(0o755)
    os.makedirs(os.path.join(state, "c"))
    b = wd.DockerBackend(
        docker=str(script), python=python, workdir=f"{prefix}/workspace", tools=f"{prefix}/tools"
    )
    return StandIn(b, state, prefix)


def play(t: EpisodeTask, backend, commands: list[str], seen: list | None = None) -> EpisodeResult:
    """The commands, one a turn, then the episode's score (`seen`: the observations)."""
    ep = Episode(t, EpisodeLimits(command=BashLimits(wall_s=30.0, cpu_s=30)), backend)
    try:
        ep.reset()
        assert not ep.done, ep.detail
        for c in commands:
            obs = ep.step(f"```bash\n{c}\n```").observation
            if seen is not None:
                seen.append(obs)
        return ep.score()
    finally:
        ep.close()


def same_verdict(a: EpisodeResult, b: EpisodeResult) -> None:
    assert (a.tests, a.resolved, a.reward, a.dropped, a.tampered, a.infra_error) == (
        b.tests,
        b.resolved,
        b.reward,
        b.dropped,
        b.tampered,
        b.infra_error,
    ), (a, b)


@pytest.fixture(scope="module")
def swe(tmp_path_factory):
    """One task of a SWE-bench JSONL imported by `asyncrl tasks import` (base_dir: its snapshot)."""
    path, insts = imported_set(str(tmp_path_factory.mktemp("swe")), ("eval",))
    (t,) = load_task_set(path)
    assert t.base_dir and not t.meta.get("image")
    return t, insts[t.task_id]


def test_an_imported_set_is_scored_in_containers_as_the_local_backend_scores_it(swe, tmp_path):
    """Honest fix resolved, empty episode not, the agent's change to a test file (and a hook it
    adds) kept out of scoring; each verdict the local backend's for the same commands."""
    t, inst = swe
    s = stand_in(tmp_path)
    test_file = t.fail_to_pass[0].split("::")[0]
    plays = {
        "honest": fix_commands(t, inst),
        "empty": ["run_tests", "submit"],
        "tamper": [
            f"printf 'def test_ok():\\n    pass\\n' > {test_file}",
            "echo 'import os' > sitecustomize.py",
            "submit",
        ],
    }
    for kind, commands in plays.items():
        seen: list[str] = []
        got = play(t, s.backend, commands, seen)
        assert got.resolved == (kind == "honest") and not got.infra_error, (kind, got)
        same_verdict(got, play(t, LocalBackend(), commands))
        if kind == "honest":
            assert got.reward == 1.0 and "<returncode>0</returncode>" in seen[-2], seen[-2]
        if kind == "empty":
            assert got.reward < 1.0 and not got.dropped
        if kind == "tamper":
            assert f"{test_file} (test file)" in got.dropped, got.dropped
            assert "sitecustomize.py (interpreter hook)" in got.dropped
    assert s.containers() == []  # episode and scoring containers all removed
    # a prediction scored through the same backend: the gold patch resolves
    assert swebench.evaluate_patch(t, inst["patch"], backend=s.backend)["resolved"]
    assert s.containers() == []


def test_the_agents_container_is_not_what_is_scored(swe, tmp_path):
    """A file the agent writes outside the workdir, and a test file it changes, do not reach the
    scoring container: it starts from the image with the scoring copy only."""
    t, inst = swe
    s = stand_in(tmp_path)
    tools = s.backend.tools
    planted = f"printf 'raise SystemExit(0)\\n' > {tools}/minitest.py; printf 'x' > {tools}/valuetest.py"
    got = play(t, s.backend, [planted, *fix_commands(t, inst)])
    assert got.resolved and not got.tampered, got  # the tools come fresh into the scoring container
    got = play(t, s.backend, [planted, "submit"])
    assert not got.resolved


def env_dir(root, python: str) -> str:
    """A built repository environment (envs/repo_env.py's layout) holding one module."""
    site = os.path.join(root, "envs", "acme__calc-1.0", "site")
    os.makedirs(site)
    with open(os.path.join(site, "envmark.py"), "w") as f:
        f.write("def double(x):\n    return 2 * x\n")
    man = {"python": python, "digest": repo_env._digest(site), "key": "acme__calc-1.0", "installed": []}
    with open(os.path.join(root, "envs", "acme__calc-1.0", repo_env.MANIFEST), "w") as f:
        json.dump(man, f)
    return os.path.dirname(site)


ENV_TESTS = (
    "import envmark\nfrom calc import quad\n\n\ndef test_quad():\n    assert quad(3) == 12\n\n\n"
    "def test_env():\n    assert envmark.double(2) == 4\n"
)


def env_task(root) -> EpisodeTask:
    """A pytest task whose repository (base_dir) needs its environment's module."""
    repo = os.path.join(root, "repo")
    os.makedirs(os.path.join(repo, "tests"))
    with open(os.path.join(repo, "calc.py"), "w") as f:
        f.write("from envmark import double\n\n\ndef quad(x):\n    return double(x)\n")
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return task(
        files={},
        hidden_tests={"tests/test_calc.py": ENV_TESTS},
        runner="pytest",
        fail_to_pass=["tests/test_calc.py::test_quad"],
        pass_to_pass=["tests/test_calc.py::test_env"],
        base_dir=repo,
        env_dir=env_dir(root, here),
    )


def system_python_without_pytest() -> str:
    for py in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.path.exists(py) or os.path.realpath(py) == os.path.realpath(sys.executable):
            continue
        r = subprocess.run(
            [py, "-c", "import sys, importlib.util as u; print(sys.version_info[:2], u.find_spec('pytest'))"],
            capture_output=True,
            text=True,
        )
        if r.stdout.strip() == f"{tuple(sys.version_info[:2])} None":
            return py
    return ""


@pytest.mark.parametrize("python", ["with-pytest", "without-pytest"])
def test_the_repository_environment_is_seen_by_commands_and_scoring(tmp_path, python):
    """Mounted in both containers, first on the python path after the pytest copy (brought in when
    the image's python has none), as the local sandbox has it; the verdicts are the local ones."""
    py = sys.executable if python == "with-pytest" else system_python_without_pytest()
    if not py:
        pytest.skip("no system python of this version without pytest here")
    t = env_task(str(tmp_path / "set"))
    s = stand_in(tmp_path, python=py)
    fix = "sed -i 's/return double(x)/return double(double(x))/' calc.py"
    seen: list[str] = []
    look = "python -c 'import envmark, pytest, sys; print(envmark.__file__, pytest.__file__, sys.executable)'"
    got = play(t, s.backend, [look, fix, "submit"], seen)
    assert f"{wd.env_target(s.backend)}/envmark.py" in seen[0], seen[0]
    assert (f"{wd.site_target(s.backend)}/pytest" in seen[0]) == (python == "without-pytest"), seen[0]
    assert got.resolved and got.reward == 1.0, got
    if python == "with-pytest":  # the local verdicts (the same whichever python the image has)
        same_verdict(got, play(t, LocalBackend(), [fix, "submit"]))
    got = play(t, s.backend, ["submit"])
    assert got.tests == {"tests/test_calc.py::test_quad": False, "tests/test_calc.py::test_env": True}, got
    if python == "with-pytest":
        same_verdict(got, play(t, LocalBackend(), ["submit"]))
    assert s.containers() == []


def test_an_environment_for_another_python_is_a_workspace_failure(tmp_path):
    t = dataclasses.replace(env_task(str(tmp_path / "set")), env_dir=env_dir(str(tmp_path / "other"), "2.7"))
    s = stand_in(tmp_path)
    ep = Episode(t, EpisodeLimits(), s.backend)
    try:
        ep.reset()
        assert ep.done and ep.infra == "workspace" and "built for python 2.7" in ep.detail, ep.detail
    finally:
        ep.close()
    assert s.containers() == []


def test_an_image_only_task_is_scored_against_the_images_tree(tmp_path):
    """An instance with only `image_name`: its repository is the image's workdir, there and for the
    scoring copy; the local backend refuses it, naming the docker backend."""
    s = stand_in(tmp_path)
    repo = {"calc.py": "def add(a, b):\n    return a - b\n", "README": "calc\n", "tests/test_calc.py": TESTS}
    s.image("acme/calc:1", repo)
    t = task(files={}, meta={"image": "acme/calc:1"})
    fix = "sed -i 's/a - b/a + b/' calc.py"
    got = play(t, s.backend, ["cat README", fix, "submit"])
    assert got.resolved and not got.dropped, got
    got = play(t, s.backend, ["rm README", "submit"])
    assert not got.resolved and not got.infra_error, got
    ep = Episode(t, EpisodeLimits())
    try:
        ep.reset()
        assert (
            ep.done and "only in its image acme/calc:1" in ep.detail and 'workspace = "docker"' in ep.detail
        )
    finally:
        ep.close()


@pytest.mark.skipif(not wd.available(), reason="no working docker daemon here")
def test_an_episode_runs_in_a_container():
    """The oracle episode of a generated task in a python image: same observations and score as local."""
    from envs.episode import Episode
    from envs.oracle import run_oracle

    b = wd.DockerBackend()
    _, turns, res = run_oracle(task(), EpisodeLimits(command=BashLimits(wall_s=20.0)), b)
    assert res.reward == 1.0 and res.termination == "submitted", (res, turns)
    ep = Episode(task(), EpisodeLimits(command=BashLimits(wall_s=2.0)), b)
    try:
        ep.reset()
        r = ep.step(
            "```bash\ncat /etc/hostname; "
            "python -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), 2)'\n```"
        )
        assert "exit code" in r.observation or "Error" in r.observation
        r = ep.step("```bash\nsleep 60\n```")
        assert "wall timeout" in r.observation
        ep.step("```bash\nsubmit\n```")
        assert ep.score().reward == 0.0
    finally:
        ep.close()
    out = subprocess.run(
        ["docker", "ps", "-a", "--filter", "label=asyncrl.episode=1", "-q"], capture_output=True
    )
    assert out.stdout.strip() == b""  # every container removed


def test_the_worker_config_selects_the_backend(swe, tmp_path):
    from rollout_worker.config import WorkerConfig
    from rollout_worker.episodes import workspace_backend

    def backend(**episodes):  # the [worker.episodes] section, handed whole to workspace_backend
        return workspace_backend(WorkerConfig(worker_id="w", episodes=episodes).episodes)

    assert backend() is None  # local: the default
    b = backend(workspace="docker", docker_image="swe:1")
    assert isinstance(b, wd.DockerBackend) and b.image == "swe:1"
    assert backend(workspace="docker").image == wd.DockerBackend().image
    with pytest.raises(ValueError, match=r"\[worker.episodes\] workspace: .* \(got 'podman'\)"):
        WorkerConfig(worker_id="w", episodes={"workspace": "podman"})
    # an imported task runs in docker_image unless its instance names an image (meta["image"])
    t, _ = swe
    s = stand_in(tmp_path)
    mine = dataclasses.replace(s.backend, image=b.image)
    for each, image in (
        (t, "swe:1"),
        (dataclasses.replace(t, meta={**t.meta, "image": "acme/x:2"}), "acme/x:2"),
    ):
        ws = mine.create(each, EpisodeLimits())
        try:
            assert not ws.error, ws.error
            with open(os.path.join(s.state, "c", ws.name, "meta.json")) as f:
                assert json.load(f)["image"] == image
            top = sorted(os.listdir(t.base_dir))
            assert ws.run("ls", BashLimits()).stdout.decode().split() == top  # the snapshot is the workdir
        finally:
            ws.close()


def test_tasks_evaluate_scores_in_containers_when_asked(tmp_path, capsys):
    """`asyncrl tasks evaluate --workspace docker [--docker-image IMG]` hands the container backend
    to the scoring; the default stays the local sandbox."""
    import argparse

    from asyncrl import tasks as tasks_cli

    ns = argparse.Namespace(workspace="docker", docker_image="python:3.11-slim")
    assert tasks_cli.scoring_backend(ns) == wd.DockerBackend(image="python:3.11-slim")
    assert (
        tasks_cli.scoring_backend(argparse.Namespace(workspace="docker", docker_image=""))
        == wd.DockerBackend()
    )
    assert tasks_cli.scoring_backend(argparse.Namespace(workspace="local", docker_image="")) is None
    preds = tmp_path / "p.jsonl"
    preds.write_text("")
    rc = tasks_cli.main(["evaluate", str(preds), "--tasks", str(tmp_path / "none"), "--workspace", "docker"])
    assert rc == 2 and "asyncrl tasks evaluate" in capsys.readouterr().err
