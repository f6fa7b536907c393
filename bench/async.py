"""Async vs sync RL on the same workload, side by side in one invocation.

    python -m bench.async --json [--steps 100] [--config bench/async.toml] [--out DIR]

Runs `asyncrl up` twice through the same processes — once asynchronous (workers never wait,
trainer consumes whatever is scored, max_lag bounds staleness) and once `--sync` (max_lag 0 and
a barrier: the trainer publishes one batch per version and waits for all of it; workers wait for
the new version). The env `arith-long` has a long-tailed completion length (a few tasks need
far more tokens than the median), the setting where synchronous RL idles most.

Both runs start from the same policy: the bench warm-starts it once (supervised, on the env's
demonstrations) and hands both trainers that checkpoint. Throughput is measured on the trainer's
own clock between its first and last step (start-up excluded), so both runs count the same
number of trained samples; each run's final weights are then scored on the same held-out
prompts, so "as good as sync" is a measured number, not an assumption.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from asyncrl.report import read_jsonl


def warm_start_once(config: str, out: Path, eval_prompts: int, init: str | None = None) -> tuple[str, dict]:
    """Warm-start the bench policy once (or take `init`, an HF folder an earlier run wrote);
    returns a config that inits both runs from it, and the warm start's numbers."""
    import tomllib

    import torch

    from asyncrl.launch import write_toml
    from kernel import load_config
    from policy import inference_state, load_hf_checkpoint, load_tokenizer, save_hf_checkpoint
    from trainer.config import TrainerConfig
    from trainer.evaluate import evaluate
    from trainer.factory import build_model
    from trainer.warmstart import warm_start

    conf = tomllib.loads(Path(config).read_text())
    cfg = load_config(TrainerConfig, config, section="trainer")
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    if init:
        mcfg, model = load_hf_checkpoint(init)
        steps = 0
    else:
        model, mcfg = build_model(cfg)
        warm_start(model, cfg, mcfg, style=cfg.warmstart.style)
        init, steps = save_hf_checkpoint(model, out / "init"), cfg.warmstart.steps
    warm_s = time.perf_counter() - t0
    ev = evaluate(
        inference_state(model),
        mcfg,
        load_tokenizer(cfg.policy.tokenizer),
        cfg.tasks.envs,
        cfg.tasks.sampling,
        eval_prompts,
        cfg.run.seed,
    )
    t = conf.setdefault("trainer", {})
    t["policy"] = {**t.get("policy", {}), "init_checkpoint": str(init)}
    t["warmstart"] = {**t.get("warmstart", {}), "steps": 0}
    derived = out / "bench-async.toml"
    write_toml(derived, conf)
    return str(derived), {
        "warmstart_steps": steps,
        "warmstart_s": warm_s,
        "initial_eval_success": ev["eval_success"],
    }


def final_eval(run_dir: Path, config: str, n: int) -> dict:
    """Held-out success of a run's last checkpoint (bf16, as the workers would sample it)."""
    from kernel import load_config
    from policy import inference_state, load_tokenizer
    from scorer.calibrate import load_policy_file
    from trainer.config import TrainerConfig
    from trainer.evaluate import evaluate

    cfg = load_config(TrainerConfig, config, section="trainer")
    model, source = load_policy_file(str(run_dir / "checkpoints"))
    ev = evaluate(
        inference_state(model),
        model.cfg,
        load_tokenizer(cfg.policy.tokenizer),
        cfg.tasks.envs,
        cfg.tasks.sampling,
        n,
        cfg.run.seed,
    )
    return {"eval_success": ev["eval_success"], "eval_tokens": ev["eval_tokens"], "eval_checkpoint": source}


def run_once(config: str, steps: int, sync: bool, run_dir: Path, minutes: float) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "up",
        "--config",
        config,
        "--steps",
        str(steps),
        "--minutes",
        str(minutes),
        "--run-dir",
        str(run_dir),
        "--quiet",
    ] + (["--sync"] if sync else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return summarize(run_dir, "sync" if sync else "async")


def summarize(run_dir: Path, label: str = "") -> dict:
    steps_rows = [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "samples" in r]
    if len(steps_rows) < 3:
        raise RuntimeError(f"{label} run made only {len(steps_rows)} steps; see {run_dir}/logs")
    # window: first step .. last step on the trainer's clock; samples trained after the first step
    t0, t1 = steps_rows[0]["ts"], steps_rows[-1]["ts"]
    samples = sum(r["live_samples"] for r in steps_rows[1:])
    # tokens too: async trains short completions first (they finish first), so samples/s alone
    # flatters it when lengths are long-tailed
    tokens = sum(r["live_samples"] * r["cost_mean"] for r in steps_rows[1:])
    occ = []
    for f in (run_dir / "metrics").glob("rollout_worker-*.jsonl"):
        occ += [
            r["slot_occupancy"]
            for r in read_jsonl(f)
            if t0 <= r.get("ts", t0) <= t1 and "slot_occupancy" in r
        ]
    tail = steps_rows[-max(3, len(steps_rows) // 4) :]
    return {
        "samples_per_s": samples / max(t1 - t0, 1e-9),
        "tokens_per_s": tokens / max(t1 - t0, 1e-9),
        "worker_idle_frac": float(1 - np.mean(occ)) if occ else None,
        "mean_staleness": float(np.mean([r["staleness_mean"] for r in steps_rows])),
        "dropped_stale": int(sum(r["dropped_stale"] for r in steps_rows)),
        "final_success": float(np.mean([r["success_mean"] for r in tail])),
        "tokens_per_answer": float(np.mean([r["cost_mean"] for r in steps_rows])),
        "steps": len(steps_rows),
        "run_dir": str(run_dir),
    }


def plot_compare(out: Path, result: dict) -> Path:
    """async-vs-sync.png: trained samples over time, train success vs trained samples, and the
    async run's staleness histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncrl.report import staleness_hist

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in ("async", "sync"):
        rows = [r for r in read_jsonl(out / name / "metrics" / "trainer.jsonl") if "samples" in r]
        t = np.array([r["ts"] for r in rows]) - rows[0]["ts"]
        n = np.cumsum([r["live_samples"] for r in rows])
        a.plot(t, n, label=f"{name}: {result[f'{name}_samples_per_s']:.1f} samples/s")
        succ = np.array([r["success_mean"] for r in rows])
        k = min(10, len(succ))
        b.plot(
            n[k - 1 :],
            np.convolve(succ, np.ones(k) / k, mode="valid"),
            label=f"{name} (mean of {k} versions)",
        )
        if name == "async":
            hist = staleness_hist(rows)
            c.bar(sorted(hist), [hist[x] for x in sorted(hist)])
    a.set(title=f"trained samples (speedup {result['speedup']:.2f}x)", xlabel="seconds since first step")
    b.set(title="success on training batches", xlabel="trained samples")
    c.set(
        title=f"async staleness (mean {result['mean_staleness_async']:.2f})",
        xlabel="versions behind",
        ylabel="samples",
    )
    for ax in (a, b):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "async-vs-sync.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.async", description=__doc__)
    ap.add_argument("--config", default=str(Path(__file__).with_name("async.toml")))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument(
        "--eval-prompts", type=int, default=512, help="held-out prompts scored per run at the end"
    )
    ap.add_argument("--minutes", type=float, default=8.0, help="per run")
    ap.add_argument("--out", default=None, help="run dirs go here (default: a temp dir)")
    ap.add_argument(
        "--init",
        default=None,
        help="start both runs from this HF folder (e.g. <earlier --out>/init) instead of warm-starting",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--summarize", action="store_true", help="only re-read the runs already under --out")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="bench-async-"))
    out.mkdir(parents=True, exist_ok=True)
    if a.summarize:
        config, warm = str(out / "bench-async.toml"), {}
        res_async, res_sync = summarize(out / "async", "async"), summarize(out / "sync", "sync")
    else:
        config, warm = warm_start_once(a.config, out, a.eval_prompts, a.init)
        res_async = run_once(config, a.steps, False, out / "async", a.minutes)
        res_sync = run_once(config, a.steps, True, out / "sync", a.minutes)
    for res, name in ((res_async, "async"), (res_sync, "sync")):
        res.update(final_eval(out / name, config, a.eval_prompts))
    result = {
        "async_samples_per_s": res_async["samples_per_s"],
        "sync_samples_per_s": res_sync["samples_per_s"],
        "speedup": res_async["samples_per_s"] / res_sync["samples_per_s"],
        "async_tokens_per_s": res_async["tokens_per_s"],
        "sync_tokens_per_s": res_sync["tokens_per_s"],
        "token_speedup": res_async["tokens_per_s"] / res_sync["tokens_per_s"],
        "worker_idle_frac_async": res_async["worker_idle_frac"],
        "worker_idle_frac_sync": res_sync["worker_idle_frac"],
        "mean_staleness_async": res_async["mean_staleness"],
        "final_success_async": res_async["final_success"],
        "final_success_sync": res_sync["final_success"],
        # the same held-out prompts, each run's last weights: is async as good as sync?
        "final_eval_success_async": res_async["eval_success"],
        "final_eval_success_sync": res_sync["eval_success"],
        "eval_prompts": a.eval_prompts,
        **warm,
        "tokens_per_answer_async": res_async["tokens_per_answer"],
        "tokens_per_answer_sync": res_sync["tokens_per_answer"],
        "dropped_stale_async": res_async["dropped_stale"],
        "steps": {"async": res_async["steps"], "sync": res_sync["steps"]},
        "runs": {"async": res_async, "sync": res_sync},
    }
    result["plot"] = str(plot_compare(out, result))
    if not a.json:
        for k, v in result.items():
            if k != "runs":
                print(f"{k:>26}: {v}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
