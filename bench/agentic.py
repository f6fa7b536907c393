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
    a = np.asarray(xs, dtype=float)
    return {"n": len(xs), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "max": float(a.max())}


def episode_stats(run_dir: Path) -> dict:
    """From the workers' per-episode records (metrics/rollout_worker-*.jsonl, `episodes_ended`),
    between the trainer's first and last step."""
    steps = [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "samples" in r]
    t0, t1 = (steps[0]["ts"], steps[-1]["ts"]) if steps else (0.0, float("inf"))
    eps = []
    for f in (run_dir / "metrics").glob("rollout_worker-*.jsonl"):
        for r in read_jsonl(f):
            if t0 <= r.get("ts", t0) <= t1 + 60:       # an episode is recorded up to a beat after it ends
                eps += r.get("episodes_ended") or []
    wall = sum(e["wall_s"] for e in eps)
    return {
        "episodes": len(eps),
        "episode_tokens": pcts([e["tokens"] for e in eps]),
        "episode_model_tokens": pcts([e["model_tokens"] for e in eps]),
        "turns": pcts([e["turns"] for e in eps]),
        "turns_hist": dict(sorted(Counter(int(e["turns"]) for e in eps).items())),
        "tool_calls": pcts([e["tool_calls"] for e in eps]),
        "terminations": dict(Counter(e["termination"] for e in eps)),
        "tool_wall_share": sum(e["tool_wall_s"] for e in eps) / wall if wall else None,
        "episode_wall_s": pcts([e["wall_s"] for e in eps]),
    }


def summarize(config: str, run_dir: Path, name: str, sync: bool, a, run: bool = False) -> dict:
    """Run (`run`) or re-read one side: bench.async's throughput numbers, held-out success of its
    last weights, the episode distributions."""
    res = bench_async.run_once(config, a.steps, sync, run_dir, a.minutes) if run else \
        bench_async.summarize(run_dir, name)
    res.update(bench_async.final_eval(run_dir, config, a.eval_prompts))
    res.update(episode_stats(run_dir))
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
        config, warm = bench_async.warm_start_once(base, out, a.eval_prompts, a.init)
    for name, sync in (("async", False), ("sync", True)):
        runs[name] = summarize(config, out / name, name, sync, a) if a.summarize else \
            summarize(config, out / name, name, sync, a, run=True)
    ra, rs = runs["async"], runs["sync"]
    result = {
        "async_samples_per_s": ra["samples_per_s"],
        "sync_samples_per_s": rs["samples_per_s"],
        "speedup": ra["samples_per_s"] / rs["samples_per_s"],
        "worker_idle_frac_async": ra["worker_idle_frac"],
        "worker_idle_frac_sync": rs["worker_idle_frac"],
        "tool_wall_share_async": ra["tool_wall_share"],
        "tool_wall_share_sync": rs["tool_wall_share"],
        "turns_async": ra["turns"], "turns_sync": rs["turns"],
        "episode_tokens_async": ra["episode_tokens"], "episode_tokens_sync": rs["episode_tokens"],
        "terminations_async": ra["terminations"], "terminations_sync": rs["terminations"],
        "mean_staleness_async": ra["mean_staleness"],
        "final_eval_success_async": ra["eval_success"],
        "final_eval_success_sync": rs["eval_success"],
        "eval_episodes": a.eval_prompts, **warm,
        "steps": {"async": ra["steps"], "sync": rs["steps"]},
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
