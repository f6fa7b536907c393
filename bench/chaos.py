"""Chaos benchmark: the fault scenarios of bench/chaoskit (registry.py) in sequence, each bounded.

    python -m bench.chaos --json                      # from the repo root; last line: one JSON object
    python -m bench.chaos --only worker_sigkill,nats_restart --tasks 100

Real trainer / scorer / rollout-worker processes on a real nats-server (loopback only); faults
are SIGKILL, SIGSTOP/SIGCONT, a nats-server kill + restart on the same store, and one node of a
3-node R3 cluster killed. Per scenario:

tasks               tasks fed during the run (each a group of 2 completions)
lost                tasks not fully consumed by the trainer (must be 0)
duplicates_trained  rollout ids in more than one trainer step (must be 0)
trained / dropped   rollout ids trained with weight > 0 / consumed with weight 0 (stale, group of one)
first_version_after_death_s   leader scenarios: death -> first delta published by the new leader
recovery_s          worker/scorer/pause: fault -> every task delivered before it is finished
                    (target ack_wait + 10 s); leader: kill/pause -> a new holder of the lease
                    (target lease TTL + 5 s); nats/cluster: fault -> next policy version
passed              the scenario's own checks and lost == duplicates_trained == 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from .chaoskit.registry import SCENARIOS


async def run_one(name: str, run_dir: Path, tasks: int | None, timeout_s: float) -> list[dict]:
    fn = SCENARIOS[name]
    kw = {"tasks": tasks} if tasks and name != "backlog_10k" else {}
    t0 = time.monotonic()
    try:
        out = await asyncio.wait_for(fn(run_dir, **kw), timeout_s)
    except Exception as e:  # a failed or timed-out scenario is a row, not a crash of the bench
        out = {
            "name": name,
            "tasks": tasks or 0,
            "lost": None,
            "duplicates_trained": None,
            "recovery_s": None,
            "passed": False,
            "error": f"{type(e).__name__}: {str(e)[:400]}",
            "logs": str(run_dir / "logs"),
        }
    rows = out if isinstance(out, list) else [out]
    for r in rows:
        r["wall_s"] = round(time.monotonic() - t0, 1)
    return rows


async def run(names: list[str], tasks: int | None, timeout_s: float, keep: str | None) -> dict:
    base = Path(keep or tempfile.mkdtemp(prefix="asyncrl-chaos-"))
    rows = []
    for name in names:
        d = base / name
        d.mkdir(parents=True, exist_ok=True)
        rows += await run_one(name, d, tasks, timeout_s)
        print(f"{rows[-1]['name']}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return {"scenarios": rows, "passed": all(r["passed"] for r in rows), "run_dir": str(base)}


def main(argv=None) -> int:
    from kernel import setup_logging

    ap = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--json", action="store_true", help="print only the JSON result line on stdout")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    ap.add_argument(
        "--tasks", type=int, default=None, help="tasks per scenario (default: each scenario's own)"
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="bound per scenario, seconds")
    ap.add_argument("--keep", default=None, help="directory for run dirs and logs (default: a temp dir)")
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n] or list(SCENARIOS)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {list(SCENARIOS)}")
    setup_logging("bench.chaos", json=False, level="warning")
    res = asyncio.run(run(names, a.tasks, a.timeout, a.keep))
    if not a.json:
        print(f"{'scenario':26} {'tasks':>6} {'lost':>5} {'dup':>4} {'recovery_s':>10} {'passed':>6}")
        for r in res["scenarios"]:
            print(
                f"{r['name']:26} {r['tasks']!s:>6} {r['lost']!s:>5} {r['duplicates_trained']!s:>4} "
                f"{r['recovery_s']!s:>10} {r['passed']!s:>6}"
            )
    print(json.dumps(res, default=str))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
