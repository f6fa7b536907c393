"""Task builders: AST mutations, generated repositories, HumanEval, real packages from a source
distribution (a tiny package made here, no network), the task-set format and the oracle."""

from __future__ import annotations

import ast
import io
import json
import os
import random
import tarfile

import pytest

from asyncrl import tasks as tasks_cli
from bench.tiny_package import TINY_SRC, write_sdist
from envs import gen_repos, humaneval_tasks
from envs.episode import Episode, EpisodeLimits, EpisodeTask
from envs.mutations import KINDS, Mutation, balanced_order, candidates, counts_by_kind
from envs.oracle import function_fix, oracle_actions, run_oracle
from envs.sandbox import BashLimits
from envs.task_set import load_task_set, write_task_set
from envs.task_validation import BuildReport
from envs.workspace import default_root

SRC = '''"""doc"""
LIMIT = 10


def f(xs, n):
    """Sum of the doubled items above n at even positions."""
    out = []  # a comment that must survive
    for i in range(len(xs)):
        if xs[i] > n and i % 2 == 0:
            out.append(xs[i] * 2)
    total = 0
    total += sum(out)
    return total if total < LIMIT else LIMIT
'''

# -- mutations ----------------------------------------------------------------------------------


def test_every_kind_is_found_and_edits_one_spot():
    muts = candidates(SRC, "m.py")
    counts = counts_by_kind(muts)
    assert all(counts[k] > 0 for k in KINDS), counts
    for m in muts:
        assert ast.dump(ast.parse(m.source)) != ast.dump(ast.parse(SRC))
        assert "# a comment that must survive" in m.source or m.kind == "remove_statement"
        changed = [a for a, b in zip(SRC.splitlines(), m.source.splitlines()) if a != b]
        assert m.kind == "remove_statement" or len(changed) == 1, m.describe()
    assert candidates(SRC, "m.py") == muts  # deterministic
    assert not any(m.kind == "remove_statement" and m.line <= 2 for m in muts)  # module level kept
    assert candidates("def broken(:\n", "x.py") == []


def test_balanced_order_spreads_over_kinds():
    muts = candidates(SRC, "m.py")
    order = balanced_order(muts, random.Random(0))
    assert sorted(map(id, order)) == sorted(map(id, muts))
    assert len({m.kind for m in order[: len(KINDS)]}) == len(KINDS)
    assert order == balanced_order(muts, random.Random(0))


def test_precedence_is_kept_by_parentheses():
    muts = candidates(
        "def g(a, b):\n    if a > 0 and b > 0:\n        return 1\n    return 0\n",
        "g.py",
        kinds=("invert_condition",),
    )
    assert [m.after.strip() for m in muts] == ["if not (a > 0 and b > 0):"]
    # b * c -> b + c inside a - ...: only parentheses keep the mutation the AST meant
    muts = candidates("def g(a, b, c):\n    return a - b * c\n", "g.py", kinds=("swap_operator",))
    assert sorted(m.after.strip() for m in muts) == ["return a + b * c", "return a - (b + c)"]


# -- tier 1 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gen_tasks():
    report = BuildReport()
    return gen_repos.build(3, seed=7, report=report), report


def test_generated_repos_are_validated_and_deterministic(gen_tasks):
    tasks, report = gen_tasks
    assert len(tasks) >= 2
    for t in tasks:
        assert t.fail_to_pass and t.meta["kind"] in KINDS and t.split in ("train", "eval")
        assert set(t.hidden_tests) == {p for p in t.files if p.startswith("tests/")}
        assert t.files[t.meta["path"]] != t.hidden_tests.get(t.meta["path"])
    d = report.to_dict()["families"]["gen-repo"]
    assert d["tasks"] == len(tasks) and d["tried"] >= len(tasks) and 0 < d["kept_fraction"] <= 1
    assert sum(v["kept"] for v in d["by_kind"].values()) == len(tasks)
    again = gen_repos.build(1, seed=7)
    assert again[0].to_dict() == tasks[0].to_dict()
    assert gen_repos.make_repo(random.Random(1)) != gen_repos.make_repo(random.Random(2))


def test_eval_split_is_an_exact_quota_topped_up_to_min_eval(gen_tasks):
    """Repositories target a split by an exact quota of their index (48 repos at 0.2: 9 eval, not the
    ~5 a per-bug hash left); min_eval adds eval repositories after the n requested, leaving the
    training tasks as they were; every task's bug identity still falls in its own split."""
    targets = [gen_repos.target_split(i, 0.2) for i in range(48)]
    assert targets.count("eval") == 9 and targets[:5] == ["train"] * 4 + ["eval"]
    assert [gen_repos.target_split(i, 1 / 3) for i in range(48)].count("eval") == 16
    assert all(gen_repos.target_split(i, 0.0) == "train" for i in range(48))
    tasks, _ = gen_tasks
    report = BuildReport()
    topped = gen_repos.build(3, seed=7, min_eval=2, report=report)
    assert [t.to_dict() for t in topped[: len(tasks)]] == [t.to_dict() for t in tasks]  # n repos unchanged
    extra = topped[len(tasks) :]
    assert sum(t.split == "eval" for t in topped) >= 2 and extra and all(t.split == "eval" for t in extra)
    assert all(int(t.task_id.rsplit("-", 1)[1]) >= 3 for t in extra)
    for t in topped:
        assert (
            gen_repos.bug_split(
                Mutation(
                    t.meta["kind"], t.meta["path"], t.meta["line"], t.meta["before"], t.meta["after"], ""
                ),
                0.2,
            )
            == t.split
        )
    with pytest.raises(ValueError, match="eval_fraction"):
        gen_repos.build(1, eval_fraction=1.0)


def test_oracle_solves_and_doing_nothing_does_not(gen_tasks):
    tasks, _ = gen_tasks
    for t in tasks:
        msgs, turns, res = run_oracle(t)
        assert res.reward == 1.0 and res.termination == "submitted" and len(turns) == 5, (t.task_id, turns)
        assert "FAILED" in turns[0]["observation"] and "0 failed" in turns[3]["observation"]
        assert (
            'File "tests/test_' in turns[0]["observation"]
            and os.path.basename(default_root()) not in turns[0]["observation"]
        )
    ep = Episode(tasks[0])
    try:
        ep.reset()
        ep.step("```bash\nsubmit\n```")
        res = ep.score()
        assert res.reward == len(tasks[0].pass_to_pass) / (
            len(tasks[0].pass_to_pass) + len(tasks[0].fail_to_pass)
        )
    finally:
        ep.close()
    assert all("```bash" in a for a in oracle_actions(tasks[0]))


def _mutant_task(m) -> EpisodeTask:
    return EpisodeTask(
        "t",
        "gen-repo",
        "train",
        "",
        {m.path: m.source},
        {},
        "mini",
        [],
        [],
        [],
        meta={"kind": m.kind, "path": m.path, "line": m.line, "before": m.before, "after": m.after},
    )


def test_oracle_rewrites_the_whole_function_that_holds_the_bug():
    """Every bug inside a function gets the same fix text (the original function), so a policy can
    learn it from other bugs of that function; the SEARCH text is the mutant's function, once."""
    from envs.repo_bank import MODULES

    src = MODULES["mathutil"][0]
    fn = src[src.index("def digit_sum") :]
    inside = [m for m in candidates(src, "mathutil.py") if src.index("def digit_sum") < src.find(m.before)]
    assert {m.kind for m in inside} >= {"remove_statement", "change_constant", "swap_operator"}
    for m in inside:
        t = _mutant_task(m)
        path, name, start, end, search, replace = function_fix(t)
        assert (path, name, replace) == ("mathutil.py", "digit_sum", fn), m.describe()
        assert m.source.count(search) == 1 and m.source.replace(search, replace) == src
        assert m.source.splitlines(keepends=True)[start - 1 : end] == search.splitlines(keepends=True)
        acts = oracle_actions(t)
        assert f"view mathutil.py {start} {end}\n" in acts[1] and replace in acts[2]
    outside = [m for m in candidates(MODULES["roman"][0], "roman.py") if m.line <= 4]  # the VALUES table
    assert outside and all(function_fix(_mutant_task(m)) is None for m in outside)
    assert f"around line {outside[0].line}" in oracle_actions(_mutant_task(outside[0]))[1]


def test_oracle_needs_a_mutation_record():
    t = EpisodeTask("x", "f", "train", "", {"a.py": "x = 1\n"}, {}, "mini", ["t.py"], ["t.py::t"], [])
    with pytest.raises(ValueError, match="no mutation record"):
        oracle_actions(t)


# -- tier 2 -------------------------------------------------------------------------------------


def test_humaneval_loader():
    problems = humaneval_tasks.load_problems()
    assert len(problems) == 164 and "HumanEval/0" in problems
    mod = humaneval_tasks.test_module(problems["HumanEval/0"])
    assert mod.count("def test_case_") == 7 and "from solution import has_close_elements" in mod
    compile(mod, "test_solution.py", "exec")


def test_humaneval_tasks():
    report = BuildReport()
    tasks = humaneval_tasks.build(limit=2, report=report)
    stubs = [t for t in tasks if t.family == "humaneval-stub"]
    fixes = [t for t in tasks if t.family == "humaneval-fix"]
    assert len(stubs) == 2 and fixes and report.to_dict()["families"]["humaneval-stub"]["tasks"] == 2
    assert {t.split for t in tasks if t.meta["problem"] == "HumanEval/0"} in ({"train"}, {"eval"})
    assert run_oracle(fixes[0])[2].reward == 1.0
    p = humaneval_tasks.load_problems()[stubs[0].meta["problem"]]
    ep = Episode(stubs[0])
    try:
        ep.reset()
        assert "0 passed" in ep.step("```bash\nrun_tests\n```").observation
        body = (p["prompt"] + p["canonical_solution"]).replace("'", "'\"'\"'")
        ep.step(f"```bash\nprintf '%s' '{body}' > solution.py\n```")
        ep.step("```bash\nsubmit\n```")
        assert ep.score().reward == 1.0
    finally:
        ep.close()


# -- tier 3: a package with its own test suite ------------------------------------------------------


def make_sdist(tmp_path, name="tinypkg-0.1", extra: dict | None = None) -> str:
    # with an egg-info folder, which the builder must leave out of the snapshot
    return write_sdist(
        str(tmp_path), name, {f"{name}/tinypkg.egg-info/PKG-INFO": "Name: tinypkg\n", **(extra or {})}
    )


def test_package_builder_on_a_tiny_package(tmp_path):
    out = tmp_path / "set"
    report = BuildReport()
    tasks = tasks_cli.build_package(
        make_sdist(tmp_path), str(out), per_package=2, seed=3, report=report, test_timeout_s=60
    )
    assert 1 <= len(tasks) <= 2
    repo = out / "repos" / "tinypkg-0.1"
    assert (repo / "tinypkg" / "__init__.py").exists() and not (repo / "tinypkg.egg-info").exists()
    for t in tasks:
        assert t.runner == "pytest" and t.test_paths == ["tests/test_tinypkg.py"]
        assert set(t.fail_to_pass) | set(t.pass_to_pass) <= {
            "tests/test_tinypkg.py::test_snake[FooBar-foo_bar]",
            "tests/test_tinypkg.py::test_snake[x-x]",
            "tests/test_tinypkg.py::test_snake[HTTPCode-h_t_t_p_code]",
            "tests/test_tinypkg.py::test_clamp",
            "tests/test_tinypkg.py::test_window_sums",
        }
        assert len(t.fail_to_pass) + len(t.pass_to_pass) == 5 and t.fail_to_pass
        assert list(t.files) == ["tinypkg/__init__.py"] and t.files["tinypkg/__init__.py"] != TINY_SRC
    d = report.to_dict()["families"]["package"]
    assert d["tasks"] == len(tasks) and d["tried"] >= len(tasks)

    write_task_set(str(out), tasks, report.to_dict())
    loaded = load_task_set(str(out))
    assert [t.task_id for t in loaded] == [t.task_id for t in tasks]
    assert loaded[0].base_dir == str(repo)
    assert load_task_set(str(out), split="eval") + load_task_set(str(out), split="train") != []
    lim = EpisodeLimits(command=BashLimits(wall_s=60, cpu_s=60), score_wall_s=60)
    msgs, turns, res = run_oracle(loaded[0], lim)  # fixable in the workspace
    assert res.reward == 1.0 and "passed" in turns[3]["observation"], turns
    ep = Episode(loaded[0], lim)  # and unfixed it fails
    try:
        ep.reset()
        ep.step("```bash\nsubmit\n```")
        assert 0 <= ep.score().reward < 1.0
    finally:
        ep.close()


def test_package_without_passing_tests_is_reported(tmp_path):
    bad = make_sdist(
        tmp_path, "broken-0.1", {"broken-0.1/tests/test_tinypkg.py": "def test_x():\n    assert 0\n"}
    )
    report = BuildReport()
    assert tasks_cli.build_package(bad, str(tmp_path / "out"), report=report, test_timeout_s=60) == []
    assert any("no test passes" in n for n in report.notes)


def test_unsafe_sdist_is_refused(tmp_path):
    path = tmp_path / "evil-0.1.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("../../escape.py")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.TarError):
        tasks_cli.unpack_sdist(str(path), str(tmp_path))
    assert not (tmp_path.parent / "escape.py").exists()


def test_cli_build_and_stats(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = tasks_cli.main(
        [
            "build",
            "--out",
            str(out),
            "--gen",
            "1",
            "--sdist",
            make_sdist(tmp_path),
            "--per-package",
            "1",
            "--json",
        ]
    )
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["families"]) <= {"gen-repo", "package"} and printed["total_tasks"] >= 1
    man = json.loads((out / "manifest.json").read_text())
    assert man["tasks"] == printed["total_tasks"] == len(load_task_set(str(out)))
    assert tasks_cli.main(["stats", str(out)]) == 0


def test_task_set_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a task set"):
        load_task_set(str(tmp_path))
    t = gen_repos.build(1, seed=1)[0]
    write_task_set(str(tmp_path), [t], {})
    with open(tmp_path / "tasks.jsonl", "a") as f:
        f.write('{"task_id": "broken"}\n')
    with pytest.raises(ValueError, match=r"tasks.jsonl:2: bad task record"):
        load_task_set(str(tmp_path))
    write_task_set(str(tmp_path), [t, t], {})
    with pytest.raises(ValueError, match="duplicate"):
        load_task_set(str(tmp_path))
    with pytest.raises(ValueError, match="unknown split"):
        load_task_set(str(tmp_path), split="test")
    with pytest.raises(ValueError, match="outside the task set"):
        write_task_set(str(tmp_path / "x"), [EpisodeTask(**{**t.to_dict(), "base_dir": str(tmp_path)})], {})


# -- a small function bank (the swe-demo tasks) ------------------------------------------------


def test_function_bank_cuts_modules_to_the_named_functions():
    bank = gen_repos.function_bank(("gcd", "clamp", "to_roman"))
    assert sorted(bank) == ["mathutil", "roman"]
    for name, (src, gens) in bank.items():
        defs = [n.name for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)]
        assert (
            sorted(defs)
            == sorted(gens)
            == sorted({"mathutil": ["clamp", "gcd"], "roman": ["to_roman"]}[name])
        )
        ns: dict = {}
        exec(compile(src, name, "exec"), ns)  # runs: the module's other statements are kept
    assert "VALUES = [" in bank["roman"][0] and bank["mathutil"][0].startswith('"""Integer helpers."""')
    assert gen_repos.function_bank(None) is gen_repos.MODULES
    with pytest.raises(ValueError, match=r"unknown bank functions \['nope'\]"):
        gen_repos.function_bank(("gcd", "nope"))
    with pytest.raises(ValueError, match=r"covered calls \['merge'\]"):
        gen_repos.function_bank(("covered",))  # it would not run without merge
    with pytest.raises(ValueError, match="unknown bank functions"):
        gen_repos.function_bank(())


def test_build_from_a_function_bank_bugs_only_its_functions():
    from envs.swe_env import TOY_LIMITS

    fns = ("gcd", "clamp", "median_low")
    tasks = gen_repos.build(4, seed=3, n_modules=1, functions=fns, eval_fraction=0.25)
    assert tasks and [t.to_dict() for t in tasks] == [
        t.to_dict() for t in gen_repos.build(4, seed=3, n_modules=1, functions=fns, eval_fraction=0.25)
    ]
    for t in tasks:
        src = [p for p in t.files if not p.startswith("tests/")]
        assert len(src) == 1 and src[0] in ("mathutil.py", "stats.py")
        assert function_fix(t)[1] in fns
        assert {x.split("::test_")[1].rsplit("_", 1)[0] for x in t.fail_to_pass + t.pass_to_pass} <= set(fns)
        msgs, turns, res = run_oracle(t, TOY_LIMITS)
        assert res.resolved and res.termination == "submitted"
    with pytest.raises(ValueError, match=r"n_modules must be in \[1, 2\]"):
        gen_repos.build(1, n_modules=3, functions=fns)


def test_cli_build_with_a_function_bank(tmp_path, capsys):
    from envs.swe_env import DEMO_FUNCTIONS

    out = tmp_path / "demo"
    assert (
        tasks_cli.main(
            [
                "build",
                "--out",
                str(out),
                "--gen",
                "2",
                "--functions",
                "DEMO",
                "--modules",
                "1",
                "--min-eval",
                "0",
            ]
        )
        == 0
    )
    ts = load_task_set(str(out))
    assert ts and all(function_fix(t)[1] in DEMO_FUNCTIONS and len(t.files) == 2 for t in ts)
    for bad in (["--functions", "gcd,nope"], ["--functions", "gcd", "--modules", "2"]):
        with pytest.raises(SystemExit):
            tasks_cli.main(["build", "--out", str(tmp_path / "bad"), "--gen", "1", *bad])
        assert "--functions / --modules" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
