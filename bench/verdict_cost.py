"""What the report-mode verdict layers cost: the scoring run with and without them, interleaved.

    python -m bench.verdict_cost --json [--reps 7] [--package inflection | --sdist PATH]

The honest fix of each report-path task (bench/reward_hacks.py's: the generated repository on the
pytest runner, the same on the mini runner's report mode, a real package's pytest suite) is played
once, then `Episode.score()` runs `--reps` times per arm, the arms alternating so load drifts hit
both alike:

    all      every layer (envs/scoring_run.py LAYERS): the isolated runner and the honeypot copies
    without  isolated_runner and honeypots off (value mode, strict report and static check stay)

Reported per task: median score seconds per arm, scored/s (1 / median) and the ratio. Value-mode
tasks and the single-turn `python-tests` verifier do not run these layers (nothing to measure).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from envs import scoring_run
from envs.episode import Episode

from . import reward_hacks as rh

ARMS = {
    "all": scoring_run.Layers(),
    "without": scoring_run.Layers(isolated_runner=False, honeypots=False),
}
REPORT_PATH = ("pytest", "mini_report", "package")


def score_seconds(task, layers: scoring_run.Layers) -> tuple[float, bool]:
    """One episode: the honest fix, then the timed scoring run under `layers`."""
    ep = Episode(task, rh.LIMITS)
    try:
        ep.reset()
        for cmd in rh.honest(task):
            ep.step(f"```bash\n{cmd}\n```")
        ep.step("```bash\nsubmit\n```")
        scoring_run.LAYERS = layers
        t0 = time.perf_counter()
        res = ep.score()
        return time.perf_counter() - t0, res.resolved
    finally:
        scoring_run.LAYERS = ARMS["all"]
        ep.close()


def measure(tasks: dict, reps: int, log=print) -> dict:
    out = {}
    for key in REPORT_PATH:
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for i in range(reps):
            order = list(ARMS) if i % 2 == 0 else list(reversed(ARMS))  # alternate who goes first
            for arm in order:
                s, resolved = score_seconds(tasks[key], ARMS[arm])
                if not resolved:
                    raise SystemExit(f"{key}: the honest fix did not resolve under {arm}")
                times[arm].append(s)
        med = {arm: statistics.median(v) for arm, v in times.items()}
        out[key] = {
            "tests": len(tasks[key].fail_to_pass) + len(tasks[key].pass_to_pass),
            "median_s": {arm: round(v, 3) for arm, v in med.items()},
            "scored_per_s": {arm: round(1 / v, 2) for arm, v in med.items()},
            "all_over_without": round(med["without"] / med["all"], 3),  # throughput ratio
        }
        log(f"{key}: {out[key]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.verdict_cost", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--package", default="inflection", help="PyPI package for the real-package task")
    ap.add_argument("--sdist", default=None, help="a local source distribution instead (no network)")
    a = ap.parse_args(argv)
    log = (lambda *x: print(*x, file=sys.stderr)) if a.json else print
    work = tempfile.mkdtemp(prefix="verdict-cost-")
    os.chmod(work, 0o700)  # expected values unreadable by sandbox uids, as in bench.reward_hacks
    try:
        tasks, info = rh.build_tasks(work, a.package, a.sdist)
        res = {
            "reps": a.reps,
            "package_source": info["package_source"],
            "load_1m_before": round(os.getloadavg()[0], 2),
            "tasks": measure(tasks, a.reps, log),
            "arms": {k: dataclasses.asdict(v) for k, v in ARMS.items()},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res) if a.json else json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
