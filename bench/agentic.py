"""Async vs sync RL on the multi-turn workload (swe-gen episodes), side by side in one invocation.

    python -m bench.agentic --json [--steps 40] [--minutes 3.5] [--config deploy/swe-demo.toml] [--out DIR]

The same procedure as bench.async (one warm start, then `asyncrl up` twice from that checkpoint:
asynchronous, then `--sync`), on deploy/swe-demo.toml's workload: tier-1 bug-fix episodes played
by the worker turn by turn, their commands run in the sandbox. An episode's length varies with
its turns (a policy that submits at once vs one that runs out of turns), and a slot waits while
the episode's command runs: the two things synchronous RL waits on.

Reported per run: trained samples/s (= episodes/s) on the trainer's clock (first to last step),
the async/sync ratio, the distributions of episode length (tokens: model turns + observations)
and of turns per episode, termination reasons, the share of episode wall time spent in tools
(the commands the agent ran, from the worker's per-episode records; scoring not included), the
worker's idle fraction (1 - slot occupancy: a slot held by an episode whose command runs counts as occupied), and
held-out success of each run's last weights (episodes on eval-split tasks).

Tiny settings check that it runs: `--steps 3 --minutes 2 --warmstart-steps 2 --eval-prompts 2`.
The defaults are sized for a quiet-box run of ~10 minutes in all.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from asyncrl.report import read_jsonl
from bench.stats import pct

bench_async = importlib.import_module("bench.async")      # `async` is a keyword: no plain import

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "deploy" / "swe-demo.toml")


def with_overrides(config: str, out: Path, **trainer) -> str:
    """A copy of `config` with [trainer] keys replaced (those given and not None)."""
    import tomllib

    from asyncrl.up import write_toml
    conf = tomllib.loads(Path(config).read_text())
    conf["trainer"] = {**conf.get("trainer", {}), **{k: v for k, v in trainer.items() if v is not None}}
    path = out / "bench-agentic-base.toml"
    write_toml(path, conf)
    return str(path)


def pcts(xs: list[float]) -> dict:
    if not xs:
        return {}
    return {"n": len(xs), "mean": float(np.mean(xs)), "p50": pct(xs, 50), "p90": pct(xs, 90),
            "p99": pct(xs, 99), "max": float(np.max(xs))}


def worker_slots(run_dir: Path) -> int:
    """Engine slots over all the run's workers, from the configs `up` wrote for them."""
    from bus import load_config
    from rollout_worker.worker import WorkerConfig
    confs = sorted((run_dir / "config").glob("worker-*.toml"))
    if not confs:
        raise RuntimeError(f"{run_dir}/config has no worker-*.toml: not an `asyncrl up` run dir")
    return sum(load_config(WorkerConfig, c).slots for c in confs)


def busy_fraction(intervals: list[tuple[float, float]], slots: int, t0: float, t1: float) -> float:
    """Mean over [t0, t1] of min(episodes in flight, slots) / slots: the share of slot-time held by
    an episode (its model turns, its commands, its scoring). A worker may start an episode before a
    slot is free (its queue), so in-flight episodes are capped at the slots."""
    if t1 <= t0 or slots < 1:
        return 0.0
    ev = sorted([(max(a, t0), 1) for a, b in intervals if b > t0 and a < t1] +
                [(min(b, t1), -1) for a, b in intervals if b > t0 and a < t1])
    busy, n, last = 0.0, 0, t0
    for t, d in ev:                      # at equal times an end (-1) sorts before a start (+1)
        busy += min(n, slots) * (t - last)
        n, last = n + d, t
    return busy / (slots * (t1 - t0))


def episode_stats(run_dir: Path) -> dict:
    """From the workers' per-episode records (metrics/rollout_worker-*.jsonl, `episodes_ended`):
    the episodes that ended between the trainer's first and last step (the window the samples/s
    is measured on), and the worker's idle fraction over that window."""
    steps = [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "samples" in r]
    if len(steps) < 2:
        raise RuntimeError(f"{run_dir}: {len(steps)} trainer steps; no window to measure episodes in")
    t0, t1 = steps[0]["ts"], steps[-1]["ts"]
    every = []
    for f in (run_dir / "metrics").glob("rollout_worker-*.jsonl"):
        for r in read_jsonl(f):
            every += r.get("episodes_ended") or []
    if every and "ended_at" not in every[0]:
        raise RuntimeError(f"{run_dir}: episode records without ended_at (a worker older than this bench)")
    eps = [e for e in every if t0 <= e["ended_at"] <= t1]
    wall = sum(e["wall_s"] for e in eps)
    spans = [(e["ended_at"] - e["wall_s"], e["ended_at"]) for e in every]
    return {
        "episodes": len(eps),
        "episode_tokens": pcts([e["tokens"] for e in eps]),
        "episode_model_tokens": pcts([e["model_tokens"] for e in eps]),
        "episode_wall_s": pcts([e["wall_s"] for e in eps]),
        "turns": pcts([e["turns"] for e in eps]),
        "turns_hist": {str(k): v for k, v in sorted(Counter(int(e["turns"]) for e in eps).items())},
        "tool_calls": pcts([e["tool_calls"] for e in eps]),
        "terminations": dict(Counter(e["termination"] for e in eps)),
        "resolved_frac": float(np.mean([bool(e["resolved"]) for e in eps])) if eps else None,
        "tool_wall_share": sum(e["tool_wall_s"] for e in eps) / wall if wall else None,
        "worker_idle_frac": 1.0 - busy_fraction(spans, worker_slots(run_dir), t0, t1),
    }


def summarize(config: str, run_dir: Path, name: str, sync: bool, a, run: bool = False) -> dict:
    """Run (`run`) or re-read one side: bench.async's throughput numbers, held-out success of its
    last weights, the episode distributions."""
    res = bench_async.run_once(config, a.steps, sync, run_dir, a.minutes) if run else \
        bench_async.summarize(run_dir, name)
    rows = [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "samples" in r]
    res["trainer_step_s"] = pcts([r["total_s"] for r in rows])
    # sync: each interval = waiting for the version's whole batch + scoring + the step + the publish
    res["step_interval_s"] = pcts(list(np.diff([r["ts"] for r in rows])))
    # bench.async's idle fraction is 1 - the engine's mean busy share per decode step: blind to
    # a slot held by an episode whose command runs and to time with no decode step at all
    res["decode_slot_occupancy"] = None if res["worker_idle_frac"] is None else 1.0 - res.pop("worker_idle_frac")
    res.update(episode_stats(run_dir))
    if a.eval_prompts:
        res.update(bench_async.final_eval(run_dir, config, a.eval_prompts))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agentic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--steps", type=int, default=40, help="versions per run")
    ap.add_argument("--minutes", type=float, default=3.5, help="per run")
    ap.add_argument("--warmstart-steps", type=int, default=None, help="default: the config's")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out episodes per evaluation")
    ap.add_argument("--out", default=None, help="run dirs go here (default: a temp dir)")
    ap.add_argument("--init", default=None, help="start both runs from this HF folder instead of warm-starting")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--summarize", action="store_true", help="only re-read the runs already under --out")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="bench-agentic-"))
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    if a.summarize:
        config, warm = str(out / "bench-async.toml"), {}
    else:
        base = with_overrides(a.config, out, warmstart_steps=a.warmstart_steps, eval_every=0)
        # the initial eval always runs (bench.async's warm start): at least one episode
        config, warm = bench_async.warm_start_once(base, out, max(a.eval_prompts, 1), a.init)
    for name, sync in (("async", False), ("sync", True)):
        runs[name] = summarize(config, out / name, name, sync, a) if a.summarize else \
            summarize(config, out / name, name, sync, a, run=True)
    ra, rs = runs["async"], runs["sync"]
    both = lambda key: {"async": ra[key], "sync": rs[key]}          # noqa: E731
    result = {
        "async_samples_per_s": ra["samples_per_s"],
        "sync_samples_per_s": rs["samples_per_s"],
        "speedup": ra["samples_per_s"] / rs["samples_per_s"],
        "token_speedup": ra["tokens_per_s"] / rs["tokens_per_s"],
        "worker_idle_frac": both("worker_idle_frac"),
        "tool_wall_share": both("tool_wall_share"),
        "turns": both("turns"), "turns_hist": both("turns_hist"),
        "episode_tokens": both("episode_tokens"), "episode_wall_s": both("episode_wall_s"),
        "tool_calls": both("tool_calls"), "terminations": both("terminations"),
        "trainer_step_s": both("trainer_step_s"), "step_interval_s": both("step_interval_s"),
        "mean_staleness_async": ra["mean_staleness"],
        "final_eval_success": both("eval_success") if a.eval_prompts else None,
        "eval_episodes": a.eval_prompts, **warm,
        "steps": both("steps"), "episodes": both("episodes"),
        "runs": runs,
    }
    if not a.json:
        for k, v in result.items():
            if k != "runs":
                print(f"{k:>26}: {v}")
    print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
