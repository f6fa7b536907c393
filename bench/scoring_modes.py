"""Which verdict each kind of task gets: value mode, or the runner's report (and how many of those
carry honeypot tests).

    python -m bench.scoring_modes [--json] [--gen N] [--humaneval N] [--task-set DIR ...]

For HumanEval tasks (`envs/humaneval_tasks.py`, both kinds), generated repositories
(`envs/gen_repos.py`) and imported tasks (task sets on disk: `asyncrl tasks build | import`; by
default the small local package of bench/tiny_package.py built with `asyncrl tasks build --sdist`):
the share scored in value mode (envs/value_tests.py), the share scored by the runner's report, and
of those the share that gets honeypot tests (envs/honeypots.py), with a fail-to-pass original among
them (the ones a forger needs). No test runs; this reads the task sets only.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile

from envs import honeypots, scoring_copy, value_tests


def modes(tasks) -> dict:
    n = len(tasks)
    out = {"tasks": n, "values": 0, "runner": 0, "runner_honeypots": 0, "runner_honeypots_f2p": 0}
    for t in tasks:
        snap = scoring_copy.snapshot(t)
        py = {
            r: d.decode("utf-8", "replace") for r, (k, d) in snap.items() if k == "file" and r.endswith(".py")
        }
        if value_tests.plan(t, py):
            out["values"] += 1
            continue
        out["runner"] += 1
        tests = {r: x for r, x in py.items() if scoring_copy.is_test_path(r, t)}
        p = honeypots.plant(t, tests, random.Random(0))
        if p.honey:
            out["runner_honeypots"] += 1
            out["runner_honeypots_f2p"] += any(v in t.fail_to_pass for v in p.honey.values())
    for k in ("values", "runner", "runner_honeypots", "runner_honeypots_f2p"):
        out[f"{k}_share"] = round(out[k] / n, 3) if n else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scoring_modes", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--gen", type=int, default=40, help="generated repositories")
    ap.add_argument("--humaneval", type=int, default=None, help="HumanEval problems (default: all)")
    ap.add_argument("--task-set", action="append", default=[], help="imported task sets (directories)")
    a = ap.parse_args(argv)
    from asyncrl import tasks as tasks_cli
    from envs import gen_repos, humaneval_tasks
    from envs.task_set import load_task_set

    from . import tiny_package

    res = {
        "humaneval": modes(humaneval_tasks.build(limit=a.humaneval)),
        "generated": modes(gen_repos.build(a.gen, seed=0)),
    }
    imported = []
    work = tempfile.mkdtemp(prefix="scoring-modes-")
    try:
        if not a.task_set:
            sd = tiny_package.write_sdist(work, conftest=True)
            imported = tasks_cli.build_package(sd, f"{work}/set", per_package=10, seed=0, test_timeout_s=60)
        for d in a.task_set:
            imported += load_task_set(d)
        res["imported"] = modes(imported)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(
                f"{k:10s} {v['tasks']:4d} tasks: value mode {v['values_share']}, runner {v['runner_share']} "
                f"(with honeypots {v['runner_honeypots_share']}, a fail-to-pass one "
                f"{v['runner_honeypots_f2p_share']})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
