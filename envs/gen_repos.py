"""Tier 1: generated repositories with one injected bug each.

A repository = a few modules from envs/repo_bank.py and a test file per module, with cases
drawn from the seed and expected values computed by the correct code. A bug is injected by one
AST mutation (envs/mutations.py); the task is kept only if the original passes every test and the
mutant fails at least one (fail-to-pass / pass-to-pass lists stored with the task). Everything is
a function of the seed and the repository's index.

Split. A bug's split is a function of its identity (module, line, mutated text, kind), so the same
bug, which can be drawn in two repositories that share a module, never lands in both splits.
A hash per bug alone leaves the eval split small and noisy (about 5 of 48 repositories), so each
repository also has a target split, an exact quota by index (repository i is an eval one when
floor((i+1)·eval_fraction) > floor(i·eval_fraction)), and only mutations whose identity falls in
that split are tried for it. `min_eval` tops the eval split up with further eval repositories
(indices n_repos, n_repos+1, ...) until it holds that many tasks: the training tasks of a build
do not depend on it, and `build(n)` is a prefix of `build(n + k)`'s repositories.
"""

from __future__ import annotations

import ast
import copy
import random

from .base import split_of
from .episode import EpisodeTask
from .mutations import balanced_order, candidates
from .repo_bank import MODULES
from .task_validation import BuildReport, fail_pass_split, run_suite

FAMILY = "gen-repo"


def function_bank(functions: tuple[str, ...] | None = None) -> dict[str, tuple[str, dict]]:
    """The modules repositories are drawn from: MODULES, or, for a small bank (a demo a toy policy
    can learn by heart), each module cut down to the named functions (its docstring and other
    top-level statements kept; modules holding none of them left out)."""
    if functions is None:
        return MODULES
    known = {fn: name for name, (_, gens) in MODULES.items() for fn in gens}
    unknown = sorted(set(functions) - set(known))
    if unknown or not functions:
        raise ValueError(f"unknown bank functions {unknown or '(none given)'}; known: {sorted(known)}")
    out = {}
    for name in sorted({known[fn] for fn in functions}):
        src, gens = MODULES[name]
        keep = {fn for fn in gens if fn in functions}
        tree = ast.parse(src)
        lines = src.splitlines(keepends=True)
        defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        head, fns = [], []
        for node in tree.body:
            text = "".join(lines[node.lineno - 1 : node.end_lineno])
            if not isinstance(node, ast.FunctionDef):
                head.append(text)
            elif node.name in keep:
                used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & (defs - keep)
                if used:
                    raise ValueError(f"bank function {node.name} calls {sorted(used)}: add them to the bank")
                fns.append(text)
        out[name] = ("\n".join(head) + "\n\n" + "\n\n".join(fns), {fn: gens[fn] for fn in sorted(keep)})
    return out


def make_repo(
    rng: random.Random, n_modules: int = 2, cases: int = 4, functions: tuple[str, ...] | None = None
) -> dict[str, str]:
    """{path: text} of a repository: modules + tests/test_<module>.py, all tests passing;
    modules from function_bank(functions)."""
    modules = function_bank(functions)
    if not 1 <= n_modules <= len(modules):
        raise ValueError(f"n_modules must be in [1, {len(modules)}] for this bank, got {n_modules}")
    names = sorted(rng.sample(sorted(modules), n_modules))
    files: dict[str, str] = {}
    for name in names:
        src, gens = modules[name]
        ns: dict = {}
        exec(compile(src, name, "exec"), ns)  # trusted bank code
        tests = [f"from {name} import {', '.join(sorted(gens))}\n"]
        for fn in sorted(gens):
            for k in range(cases):
                args = gens[fn](rng)
                try:
                    want = ns[fn](*copy.deepcopy(args))
                except Exception:
                    continue
                call = f"{fn}({', '.join(repr(a) for a in args)})"
                tests.append(f"\n\ndef test_{fn}_{k}():\n    assert {call} == {want!r}\n")
        files[f"{name}.py"] = src
        files[f"tests/test_{name}.py"] = "".join(tests)
    return files


def instruction(files: dict[str, str], fail_to_pass: list[str]) -> str:
    shown = ", ".join(fail_to_pass[:3]) + (
        f" and {len(fail_to_pass) - 3} more" if len(fail_to_pass) > 3 else ""
    )
    return (
        f"This repository has a bug: some tests fail, for example {shown}.\n"
        f"Files: {', '.join(sorted(files))}.\n"
        "Find the bug in the source code and fix it; do not change the tests. "
        "Run the tests with `run_tests`, then `submit`."
    )


MIN_EVAL = 16  # eval tasks `asyncrl tasks build --gen` and the swe-gen env ask for


def target_split(i: int, eval_fraction: float) -> str:
    """Repository i's split: an exact share of eval repositories, spread evenly over the indices."""
    return "eval" if int((i + 1) * eval_fraction) > int(i * eval_fraction) else "train"


def bug_split(m, eval_fraction: float) -> str:
    return split_of(f"{FAMILY}|{m.path}|{m.line}|{m.after}|{m.kind}", eval_fraction)


def build(
    n_repos: int,
    seed: int = 0,
    eval_fraction: float = 0.2,
    tries_per_repo: int = 6,
    n_modules: int = 2,
    cases: int = 4,
    report: BuildReport | None = None,
    min_eval: int = 0,
    functions: tuple[str, ...] | None = None,
) -> list[EpisodeTask]:
    """Up to `n_repos` tasks (one validated bug per repository), then eval repositories until the
    eval split holds `min_eval` tasks (at most 4·min_eval + 8 more tried); deterministic in `seed`.
    `functions`: draw the repositories from that small bank (function_bank) instead of every module."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if not 1 <= n_modules <= len(function_bank(functions)):  # a bad bank fails before any test runs
        raise ValueError(
            f"n_modules must be in [1, {len(function_bank(functions))}] for this bank, got {n_modules}"
        )
    report = report if report is not None else BuildReport()
    tasks = []
    for i in range(n_repos):
        task = build_repo(
            i,
            target_split(i, eval_fraction),
            seed,
            eval_fraction,
            tries_per_repo,
            n_modules,
            cases,
            report,
            functions,
        )
        tasks += [task] if task else []
    extra = n_repos
    while (
        eval_fraction > 0
        and sum(t.split == "eval" for t in tasks) < min_eval
        and extra < n_repos + 4 * min_eval + 8
    ):
        task = build_repo(
            extra, "eval", seed, eval_fraction, tries_per_repo, n_modules, cases, report, functions
        )
        tasks += [task] if task else []
        extra += 1
    if sum(t.split == "eval" for t in tasks) < min_eval:
        report.notes.append(
            f"{FAMILY}: only {sum(t.split == 'eval' for t in tasks)} eval tasks (< {min_eval})"
        )
    return tasks


def build_repo(
    i: int,
    split: str,
    seed: int,
    eval_fraction: float,
    tries_per_repo: int,
    n_modules: int,
    cases: int,
    report: BuildReport,
    functions: tuple[str, ...] | None = None,
) -> EpisodeTask | None:
    """Repository i with one validated bug whose identity falls in `split`, or None."""
    rng = random.Random(f"{FAMILY}:{seed}:{i}")
    files = make_repo(rng, n_modules, cases, functions)
    test_paths = sorted(p for p in files if p.startswith("tests/"))
    original, why = run_suite(files, "mini", test_paths)
    if not original or any(s != "PASS" for s in original.values()):
        report.notes.append(f"{FAMILY} {seed}:{i}: original does not pass ({why or original})")
        return None
    muts = balanced_order(
        [m for p in sorted(files) if not p.startswith("tests/") for m in candidates(files[p], p)], rng
    )
    for m in [m for m in muts if bug_split(m, eval_fraction) == split][:tries_per_repo]:
        mutant = {**files, m.path: m.source}
        status, _ = run_suite(mutant, "mini", test_paths)
        f2p, p2p = fail_pass_split(original, status)
        if not f2p:
            report.add(FAMILY, m.kind, False)
            continue
        report.add(FAMILY, m.kind, True, split)
        return EpisodeTask(
            task_id=f"{FAMILY}-{seed}-{i}",
            family=FAMILY,
            split=split,
            instruction=instruction(files, f2p),
            files=mutant,
            hidden_tests={p: files[p] for p in test_paths},
            runner="mini",
            test_paths=test_paths,
            fail_to_pass=f2p,
            pass_to_pass=p2p,
            meta={"kind": m.kind, "path": m.path, "line": m.line, "before": m.before, "after": m.after},
        )
    return None
