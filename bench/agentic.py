"""Async vs sync RL on the multi-turn workload (deploy/swe-demo.toml's env), side by side in one invocation.

    python -m bench.agentic --json [--minutes 3] [--warmstart-steps 60] [--out DIR] [--init DIR/init]

The same procedure as bench.async (one warm start, then `asyncrl up` twice from that checkpoint
through the same processes: asynchronous, then `--sync`), on deploy/swe-demo.toml's workload:
tier-1 bug-fix episodes played by the worker turn by turn, every command run in the sandbox.
`--sync` is the same trainer, worker and scorer with max_lag 0 and a barrier: the trainer
publishes one batch of tasks per version and steps only when every episode of it has ended (the
longest one included, its commands included); the worker starts them only on the new version.

The policy is warm-started for only --warmstart-steps (default 60 of the demo's) oracle batches:
part-way through the warm start it plays the turn format on some episodes (commands run,
observations read, up to max_turns) and breaks it early on others (two format errors end the
episode): the long-tailed mix of episode lengths that synchronous RL waits on. Each run is
bounded by --minutes (--steps is a cap); throughput is counted on the trainer's clock between its
first and last step, so the two runs need not train the same number of versions.

Reported per run (async, sync): trained samples/s (= episodes/s) and the ratio; the episodes that
ended inside that window: tokens (model turns + observations), turns (percentiles and histogram),
tool calls, wall seconds, termination reasons, tool_wall_share (seconds in the agent's commands /
episode wall seconds; scoring not included); worker_idle_frac (the share of slot-time over the
window that no episode held: an episode holds its slot while its command runs; from each
episode's end time and wall seconds); decoder_idle_frac (the share of the window without a decode
step, from the engines' decode seconds); suite_wait_share and suite_runs (long-tail: seconds waiting
on the modelled suites, scoring included, / episode wall seconds; suite runs per episode);
trainer_step_s and step_interval_s (sync: the interval is the wait for the whole batch + scoring +
the step + the weight publish); decode_slot_occupancy (the engine's busy slots per decode step,
blind to slots waiting on a command); optionally held-out success of each run's last weights
(--eval-prompts, eval-split tasks).

Workloads (the JSON's `workload` says which ran, with its caveats):
  default     the tier-1 repositories' own commands: tests in tenths of a second (tools < 1 % of an
              episode's wall time), which is not the long tail SWE episodes have
  long-tail   `--test-latency MEDIAN_S,P99_S` (e.g. 3,60): every test-suite run (the agent's
              run_tests and the scoring run) also waits a remote sandbox's suite time, one
              deterministic lognormal draw per task (envs/sandbox_latency.py: a sleep, no local
              CPU, as a suite on another machine), in both runs alike; the episode wall limit and
              the trainer's group timeout are raised to fit (--episode-wall-s, --group-timeout-s).
              `--max-inflight N` (both runs) lets N episodes be in flight on `slots` decode rows:
              an episode waiting on its command holds a KV row, not a decode row.

Tiny settings check that it runs (minutes): `--steps 3 --minutes 2 --warmstart-steps 2 --eval-prompts 0`.
`--harness mini-swe-agent` compares instead the built-in loop with mini-swe-agent driving the same
episodes through the worker's OpenAI-compatible endpoint (both async): episodes/s, tokens/s, ratios.
The defaults are sized for ~10 minutes in all on a quiet 2-core box (a first run also builds the
task set, ~1.5 min); `--init OUT/init` reuses an earlier run's warm start.
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

from .stats import pct

bench_async = importlib.import_module("bench.async")  # `async` is a keyword: no plain import

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "deploy" / "swe-demo.toml")


def with_overrides(
    config: str,
    out: Path,
    worker: dict | None = None,
    name: str = "bench-agentic-base.toml",
    up: dict | None = None,
    trainer: dict | None = None,
) -> str:
    """A copy of `config` with [up] keys, and [worker.<section>] and [trainer.<section>] keys
    ({section: {key: value}}), replaced (those given and not None)."""
    import tomllib

    from asyncrl.launch import write_toml

    conf = tomllib.loads(Path(config).read_text())
    conf["up"] = {**conf.get("up", {}), **{k: v for k, v in (up or {}).items() if v is not None}}
    for process, sections in (("worker", worker), ("trainer", trainer)):
        t = conf.setdefault(process, {})
        for section, keys in (sections or {}).items():
            t[section] = {**t.get(section, {}), **{k: v for k, v in keys.items() if v is not None}}
    path = out / name
    write_toml(path, conf)
    return str(path)


def pcts(xs: list[float]) -> dict:
    if not xs:
        return {}
    return {
        "n": len(xs),
        "mean": float(np.mean(xs)),
        "p50": pct(xs, 50),
        "p90": pct(xs, 90),
        "p99": pct(xs, 99),
        "max": float(np.max(xs)),
    }


def worker_slots(run_dir: Path) -> int:
    """Engine slots over all the run's workers, from the configs `up` wrote for them."""
    from kernel import load_config
    from rollout_worker.config import WorkerConfig

    confs = sorted((run_dir / "config").glob("worker-*.toml"))
    if not confs:
        raise RuntimeError(f"{run_dir}/config has no worker-*.toml: not an `asyncrl up` run dir")
    return sum(load_config(WorkerConfig, c).engine.slots for c in confs)


def busy_fraction(intervals: list[tuple[float, float]], slots: int, t0: float, t1: float) -> float:
    """Mean over [t0, t1] of min(episodes in flight, slots) / slots: the share of slot-time held by
    an episode (its model turns, its commands, its scoring). A worker may start an episode before a
    slot is free (its queue), so in-flight episodes are capped at the slots."""
    if t1 <= t0 or slots < 1:
        return 0.0
    ev = sorted(
        [(max(a, t0), 1) for a, b in intervals if b > t0 and a < t1]
        + [(min(b, t1), -1) for a, b in intervals if b > t0 and a < t1]
    )
    busy, n, last = 0.0, 0, t0
    for t, d in ev:  # at equal times an end (-1) sorts before a start (+1)
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
    # the decoder's idle share: window seconds without a decode step (episodes all waiting on
    # commands, on the barrier, on admission), from the engines' cumulative decode-step seconds
    busy = []
    for f in (run_dir / "metrics").glob("rollout_worker-*.jsonl"):
        beats = [r for r in read_jsonl(f) if "busy_s" in r and t0 <= r.get("ts", -1) <= t1]
        if len(beats) >= 2:
            busy.append(
                (beats[-1]["busy_s"] - beats[0]["busy_s"]) / max(beats[-1]["ts"] - beats[0]["ts"], 1e-9)
            )
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
        # long-tail workload: seconds waiting on the modelled suites (run_tests and scoring) / wall
        "suite_wait_share": sum(e.get("suite_wait_s", 0.0) for e in eps) / wall if wall else None,
        "suite_runs": pcts([e.get("suite_runs", 0) for e in eps]),
        "worker_idle_frac": 1.0 - busy_fraction(spans, worker_slots(run_dir), t0, t1),
        "decoder_idle_frac": 1.0 - float(np.mean(busy)) if busy else None,
    }


def summarize(config: str, run_dir: Path, name: str, sync: bool, a, run: bool = False) -> dict:
    """Run (`run`) or re-read one side: bench.async's throughput numbers, held-out success of its
    last weights, the episode distributions."""
    res = (
        bench_async.run_once(config, a.steps, sync, run_dir, a.minutes)
        if run
        else bench_async.summarize(run_dir, name)
    )
    rows = [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "samples" in r]
    res["trainer_step_s"] = pcts([r["total_s"] for r in rows])
    # sync: each interval = waiting for the version's whole batch + scoring + the step + the publish
    res["step_interval_s"] = pcts(list(np.diff([r["ts"] for r in rows])))
    # the share of the window the trainer spent stepping: near 1, the run is trainer-bound (more
    # overlap cannot help it); in sync, 1 - this is the barrier's wait for the batch's episodes
    res["trainer_busy_frac"] = sum(r["total_s"] for r in rows[1:]) / max(rows[-1]["ts"] - rows[0]["ts"], 1e-9)
    # bench.async's idle fraction is 1 - the engine's mean busy share per decode step: blind to
    # a slot held by an episode whose command runs and to time with no decode step at all
    res["decode_slot_occupancy"] = (
        None if res["worker_idle_frac"] is None else 1.0 - res.pop("worker_idle_frac")
    )
    res.update(episode_stats(run_dir))
    if a.eval_prompts:
        res.update(bench_async.final_eval(run_dir, config, a.eval_prompts))
    return res


def workload(run_dir: Path) -> dict:
    """Which workload a run had, from the configs `up` wrote for it: default (the repositories' own
    commands) or long-tail (a modelled remote test-suite time per task), and the knobs that shape it."""
    import tomllib

    from kernel import load_config
    from rollout_worker.config import WorkerConfig
    from trainer.sections import BatchSection

    confs = sorted((run_dir / "config").glob("worker-*.toml"))
    if not confs:
        raise RuntimeError(f"{run_dir}/config has no worker-*.toml: not an `asyncrl up` run dir")
    wc = load_config(WorkerConfig, confs[0], env_prefix="")
    trainer = run_dir / "config" / "trainer.toml"
    tc = tomllib.loads(trainer.read_text()) if trainer.exists() else {}
    lat = wc.episodes.sandbox_latency
    w = {
        "name": "long-tail" if lat.enabled else "default",
        "slots": wc.engine.slots,
        "max_inflight": wc.admission.max_inflight,
        "queue": wc.admission.queue,
        "episode_wall_s": wc.episodes.episode_wall_s or None,
        "group_timeout_s": tc.get("batch", {}).get("group_timeout_s", BatchSection.group_timeout_s),
    }
    if lat.enabled:
        w["test_latency"] = {
            "median_s": lat.median_s,
            "p99_s": lat.p99_s,
            "cap_s": lat.cap_s,
            "seed": lat.seed,
            "sigma": lat.sigma,
            "mean_s": lat.median_s * float(np.exp(lat.sigma**2 / 2)),
        }
    return w


def parse_latency(text: str) -> tuple[float, float]:
    """`MEDIAN_S,P99_S` (or `0`: off) -> (median, p99), checked."""
    parts = [float(x) for x in text.split(",")]
    if parts == [0.0]:
        return 0.0, 0.0
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"--test-latency takes MEDIAN_S,P99_S (or 0), got {text!r}")
    from envs.sandbox_latency import SandboxLatency

    try:
        SandboxLatency(median_s=parts[0], p99_s=parts[1])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return parts[0], parts[1]


def caveats(ra: dict, rs: dict, work: dict | None = None) -> list[str]:
    """What makes this run's ratio mean less than it says, from its own numbers."""
    out = []
    if work and work["name"] == "long-tail":
        lat = work["test_latency"]
        out.append(
            f"long-tail workload: the test-suite time is modelled, not measured (a lognormal draw per task, "
            f"median {lat['median_s']} s, p99 {lat['p99_s']} s, cap {lat['cap_s']} s, waited without local "
            "CPU as on a remote sandbox, on every run_tests and scoring run); the suites' results are "
            "still the tiny generated repositories' own"
        )
        runs = [r["suite_runs"]["mean"] for r in (ra, rs) if r.get("suite_runs")]
        if runs and min(runs) < 1.5:
            out.append(
                f"the policy rarely runs the tests itself ({max(min(runs) - 1, 0):.2f} run_tests per episode "
                "besides the "
                "scoring run): the long tail is mostly the scoring run's; a longer warm start "
                "(--warmstart-steps 400) plays run_tests as the oracle does"
            )
    elif work:
        out.append(
            "default workload: the generated repositories' tests run in tenths of a second, far from the "
            "seconds-to-minutes suites of real SWE episodes (see --test-latency)"
        )
    if min(ra["steps"], rs["steps"]) < 8:
        out.append(
            f"few versions ({ra['steps']} async, {rs['steps']} sync): the ratio is noisy; more --minutes"
        )
    share = {
        k: r["terminations"].get("timeout", 0) / max(r["episodes"], 1)
        for k, r in (("async", ra), ("sync", rs))
    }
    if abs(share["async"] - share["sync"]) > 0.1:
        out.append(
            f"episodes ended by the episode wall clock: {share['async']:.0%} async vs "
            f"{share['sync']:.0%} sync: "
            "decode too slow for episode_wall_s (a loaded box?), the runs saw different episodes"
        )
    if ra["trainer_busy_frac"] > 0.85:
        out.append(f"async is trainer-bound (trainer busy {ra['trainer_busy_frac']:.0%} of the window)")
    calls = [r["tool_calls"]["mean"] for r in (ra, rs) if r["tool_calls"]]
    if calls and max(calls) < 1.0:
        out.append(
            f"the policy rarely runs a command ({max(calls):.2f} per episode): more --warmstart-steps "
            "(or --init a better warm start) for a tool-using workload"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.agentic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument(
        "--steps", type=int, default=1000, help="versions per run at most (--minutes ends it first)"
    )
    ap.add_argument("--minutes", type=float, default=3.0, help="per run, start-up included")
    ap.add_argument(
        "--warmstart-steps",
        type=int,
        default=60,
        help="supervised oracle batches before both runs (0: the config's)",
    )
    ap.add_argument("--slots", type=int, default=None, help="[worker.engine] slots (default: the config's)")
    ap.add_argument(
        "--group-size", type=int, default=None, help="[trainer.batch] group_size (default: the config's)"
    )
    ap.add_argument(
        "--batch-groups", type=int, default=None, help="[trainer.batch] groups (default: the config's)"
    )
    ap.add_argument(
        "--max-lag",
        type=int,
        default=None,
        help="async staleness bound, trainer and worker (default: the config's)",
    )
    ap.add_argument(
        "--test-latency",
        type=parse_latency,
        default=(0.0, 0.0),
        metavar="MEDIAN_S,P99_S",
        help="long-tail workload: each task's test suite also takes a lognormal time with this "
        "median and p99 (a remote sandbox; both runs alike). 0: off (default workload)",
    )
    ap.add_argument("--latency-cap-s", type=float, default=300.0, help="no suite takes longer (long-tail)")
    ap.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        help="[worker.admission] max_inflight: episodes in flight on the slots (default: the config's)",
    )
    ap.add_argument(
        "--episode-wall-s",
        type=float,
        default=None,
        help="[worker.episodes] episode_wall_s (long-tail default 900: the toy limits' 120 s assume fast "
        "tests)",
    )
    ap.add_argument(
        "--group-timeout-s",
        type=float,
        default=None,
        help="[trainer.batch] group_timeout_s (long-tail default 1200)",
    )
    ap.add_argument(
        "--eval-prompts",
        type=int,
        default=0,
        help="held-out episodes to score each run's last weights on (0: skip; minutes each)",
    )
    ap.add_argument("--out", default=None, help="run dirs go here (default: a temp dir)")
    ap.add_argument(
        "--init", default=None, help="start both runs from this HF folder instead of warm-starting"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--summarize", action="store_true", help="only re-read the runs already under --out")
    ap.add_argument(
        "--harness",
        default="builtin",
        choices=("builtin", "mini-swe-agent"),
        help="mini-swe-agent: compare the harness through the OpenAI endpoint with the built-in "
        "loop (both async, same tasks) instead of async with sync",
    )
    a = ap.parse_args(argv)
    if a.test_latency[0] > 0:  # the toy limits were sized for tests in tenths of a second
        a.episode_wall_s = a.episode_wall_s or 900.0
        a.group_timeout_s = a.group_timeout_s or 1200.0
    latency = (
        {"median_s": a.test_latency[0], "p99_s": a.test_latency[1], "cap_s": a.latency_cap_s}
        if a.test_latency[0] > 0
        else None
    )
    out = Path(a.out or tempfile.mkdtemp(prefix="bench-agentic-"))
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    if a.summarize:
        config, warm = str(out / "bench-async.toml"), {}
    else:
        base = with_overrides(
            a.config,
            out,
            worker={
                "engine": {"slots": a.slots},
                "admission": {"max_lag": a.max_lag, "max_inflight": a.max_inflight},
                "episodes": {"sandbox_latency": latency, "episode_wall_s": a.episode_wall_s},
            },
            trainer={
                "warmstart": {"steps": a.warmstart_steps or None},
                "tasks": {"eval_every": 0},
                # both sides train every group (sync cannot skip: its barrier
                # waits for exactly `groups` tasks): trained samples/s compare
                "batch": {
                    "group_size": a.group_size,
                    "groups": a.batch_groups,
                    "max_lag": a.max_lag,
                    "group_timeout_s": a.group_timeout_s,
                    "skip_uniform": False,
                },
            },
        )
        # the initial eval always runs (bench.async's warm start): at least one episode
        config, warm = bench_async.warm_start_once(base, out, max(a.eval_prompts, 1), a.init)
    if a.harness != "builtin":
        return harness_comparison(a, config, out, warm)
    for name, sync in (("async", False), ("sync", True)):
        runs[name] = (
            summarize(config, out / name, name, sync, a)
            if a.summarize
            else summarize(config, out / name, name, sync, a, run=True)
        )
    ra, rs = runs["async"], runs["sync"]
    work = workload(out / "async")
    if workload(out / "sync") != work:
        raise RuntimeError(f"{out}: the async and sync runs had different workloads")
    both = lambda key: {"async": ra[key], "sync": rs[key]}  # noqa: E731
    result = {
        "workload": work,
        "async_samples_per_s": ra["samples_per_s"],
        "sync_samples_per_s": rs["samples_per_s"],
        "speedup": ra["samples_per_s"] / rs["samples_per_s"],
        "token_speedup": ra["tokens_per_s"] / rs["tokens_per_s"],
        "worker_idle_frac": both("worker_idle_frac"),
        "tool_wall_share": both("tool_wall_share"),
        "decoder_idle_frac": both("decoder_idle_frac"),
        "suite_wait_share": both("suite_wait_share"),
        "suite_runs": both("suite_runs"),
        "turns": both("turns"),
        "turns_hist": both("turns_hist"),
        "episode_tokens": both("episode_tokens"),
        "episode_wall_s": both("episode_wall_s"),
        "tool_calls": both("tool_calls"),
        "terminations": both("terminations"),
        "trainer_step_s": both("trainer_step_s"),
        "step_interval_s": both("step_interval_s"),
        "trainer_busy_frac": both("trainer_busy_frac"),
        "mean_staleness_async": ra["mean_staleness"],
        "final_eval_success": both("eval_success") if a.eval_prompts else None,
        "eval_episodes": a.eval_prompts,
        **warm,
        "steps": both("steps"),
        "episodes": both("episodes"),
        "caveats": caveats(ra, rs, work),
        "runs": runs,
    }
    return emit(result, a)


def emit(result: dict, a) -> int:
    """The result as a table (unless --json), then as the one JSON line the bench ends with."""
    if not a.json:
        for k, v in result.items():
            if k != "runs":
                print(f"{k:>26}: {v}")
    print(json.dumps(result, default=float))
    return 0


def harness_comparison(a, config: str, out: Path, warm: dict) -> int:
    """`--harness mini-swe-agent`: the same warm start and tasks played asynchronously twice, by the
    built-in loop and by the harness through the endpoint: episodes/s, tokens/s and their ratios
    (the HTTP path's overhead; the harness's own prompt/parse logic is part of it)."""
    # no after-run eval on either side: the comparison is throughput (each eval pauses minutes)
    sides = (
        {"builtin": config, "harness": config}
        if a.summarize
        else {
            "builtin": with_overrides(
                config, out, up={"final_eval": False}, name="bench-agentic-builtin.toml"
            ),
            "harness": with_overrides(
                config,
                out,
                worker={"harness": {"kind": a.harness}},
                up={"final_eval": False},
                name="bench-agentic-harness.toml",
            ),
        }
    )
    runs = {
        name: summarize(conf, out / name, name, False, a, run=not a.summarize) for name, conf in sides.items()
    }
    rb, rh = runs["builtin"], runs["harness"]
    both = lambda key: {"builtin": rb.get(key), "harness": rh.get(key)}  # noqa: E731
    result = {
        "harness": a.harness,
        "workload": workload(out / "builtin"),
        "builtin_episodes_per_s": rb["samples_per_s"],
        "harness_episodes_per_s": rh["samples_per_s"],
        "builtin_tokens_per_s": rb["tokens_per_s"],
        "harness_tokens_per_s": rh["tokens_per_s"],
        "episodes_ratio": rh["samples_per_s"] / rb["samples_per_s"] if rb["samples_per_s"] else None,
        "tokens_ratio": rh["tokens_per_s"] / rb["tokens_per_s"] if rb["tokens_per_s"] else None,
        "turns": both("turns"),
        "episode_tokens": both("episode_tokens"),
        "terminations": both("terminations"),
        "episode_wall_s": both("episode_wall_s"),
        "steps": both("steps"),
        "episodes": both("episodes"),
        **warm,
        "runs": runs,
    }
    return emit(result, a)


if __name__ == "__main__":
    sys.exit(main())
