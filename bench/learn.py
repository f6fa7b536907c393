"""A real pretrained model learning through the whole system: `python -m bench.learn --json`.

    python -m bench.learn --json [--config deploy/learn-smollm2.toml] [--runs 1] [--steps 15]
                                 [--minutes 6] [--out DIR] [--plot PNG]

Each run is one `asyncrl up` of --config (SmolLM2-135M-Instruct by default: async, deltas applied
in flight, replay on) with its [up] steps/minutes replaced by --steps/--minutes (0 keeps the
config's: the full demo) and `final_eval = true`, so the held-out success of version 0 and of the
last version are measured after the run on the same eval prompts. Per run it reports:

v0, final        held-out success of the initial and of the last policy; gain_points = 100·(final − v0)
versions         versions trained; train_s the run's wall time up to its summary minus eval_s
k3_per_version   the trainer's sampler/learner mismatch KL (k3_mean) of each version, in order
k3_mean, k3_max  over the versions that had live tokens
staleness_mean   mean version lag of the trained samples
wall_s           the whole `asyncrl up`, start to exit (training, drain, after-run evals)

With --runs N the runs go one after another and `spread` holds min/mean/max of the gain and
k3_mean; --plot writes each run's training-batch success and k3 per version (one PNG). Short by
default (the shipped demo is 40 versions in 13 minutes: `--steps 0 --minutes 0`). CPU-bound: run
it alone on the box. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.report import read_trainer_metrics

from .agentic import with_overrides

ROOT = Path(__file__).resolve().parent.parent


def summarize(run_dir: Path, wall_s: float) -> dict:
    """One run's learning figures from its summary.json and metrics/trainer.jsonl."""
    summary_path = Path(run_dir) / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{summary_path} missing: the run did not finish (see {run_dir}/logs)")
    s = json.loads(summary_path.read_text())
    v0, final = s.get("eval_success_initial"), s.get("eval_success_final")
    if v0 is None or final is None or s.get("final_eval") != "done":
        raise RuntimeError(f"{run_dir}: after-run evals missing (final_eval = {s.get('final_eval')!r})")
    steps = [r for r in read_trainer_metrics(run_dir) if "samples" in r and "k3_mean" in r]
    k3 = [[int(r["version"]), float(r["k3_mean"])] for r in steps]
    eval_s = float(s.get("final_eval_s") or 0.0)
    return {
        "run_dir": str(run_dir),
        "v0": v0,
        "final": final,
        "gain_points": round(100 * (final - v0), 1),
        "versions": s.get("versions"),
        "eval_version_final": s.get("eval_version_final"),
        "k3_per_version": k3,
        "k3_mean": statistics.fmean(k for _, k in k3) if k3 else None,
        "k3_max": max((k for _, k in k3), default=None),
        "staleness_mean": (
            statistics.fmean(float(r.get("staleness_mean") or 0.0) for r in steps) if steps else None
        ),
        "tokens_initial": s.get("eval_tokens_initial"),
        "tokens_final": s.get("eval_tokens_final"),
        "wall_s": round(wall_s, 1),
        "eval_s": round(eval_s, 1),
        "train_s": round(wall_s - eval_s, 1),
        "stopped": s.get("stopped"),
    }


def spread(runs: list[dict]) -> dict:
    out = {}
    for k in ("gain_points", "k3_mean", "train_s"):
        xs = [r[k] for r in runs if r.get(k) is not None]
        if xs:
            out[k] = {"min": min(xs), "mean": statistics.fmean(xs), "max": max(xs)}
    return out


def plot(runs: list[dict], path: Path, k3_target: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, r in enumerate(runs):
        rows = [x for x in read_trainer_metrics(Path(r["run_dir"])) if "samples" in x]
        vs = [x["version"] for x in rows]
        sx = [x.get("success_mean", 0.0) for x in rows]
        # a 4-version moving mean: one batch is 16 samples, too noisy to read alone
        sm = [statistics.fmean(sx[max(0, j - 3) : j + 1]) for j in range(len(sx))]
        (line,) = ax.plot(vs, sm, label=f"run {i + 1}: train batch (4-version mean)")
        ax.plot(
            [0, r["eval_version_final"] or vs[-1]],
            [r["v0"], r["final"]],
            "o--",
            color=line.get_color(),
            label=f"run {i + 1}: held-out {r['v0']:.2f} → {r['final']:.2f}",
        )
        k3 = r["k3_per_version"]
        bx.plot([v for v, _ in k3], [k for _, k in k3], color=line.get_color(), label=f"run {i + 1}")
    if k3_target:
        bx.axhline(k3_target, color="grey", ls=":", label=f"max_k3 {k3_target}")
    ax.set(xlabel="policy version", ylabel="success", ylim=(0, 1), title="success")
    bx.set(xlabel="policy version", ylabel="k3 (sampler vs learner)", title="mismatch KL per version")
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_once(config: str, run_dir: Path, python: str) -> float:
    """One `asyncrl up` to its end (its own limits stop it); returns its wall seconds."""
    cmd = [python, "-m", "asyncrl.cli", "up", "--config", config, "--run-dir", str(run_dir), "--quiet"]
    t0 = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}-up.out", "wb") as out:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"asyncrl up exited {rc}; see {run_dir.parent / (run_dir.name + '-up.out')}")
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    import tomllib

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "deploy" / "learn-smollm2.toml"))
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=15, help="versions per run (0: the config's)")
    ap.add_argument("--minutes", type=float, default=6.0, help="training minutes per run (0: the config's)")
    ap.add_argument("--out", default=None, help="run dirs go here (default: a temp dir)")
    ap.add_argument("--plot", default=None, help="PNG of success and k3 per version, every run")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    a = ap.parse_args(argv)
    if a.runs < 1 or a.steps < 0 or a.minutes < 0:
        ap.error("--runs must be >= 1, --steps and --minutes >= 0")
    out = Path(a.out or tempfile.mkdtemp(prefix="bench-learn-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    up = {"final_eval": True, "steps": a.steps or None, "minutes": a.minutes or None}
    conf = with_overrides(a.config, out, name="bench-learn.toml", up=up)
    k3_target = tomllib.loads(Path(conf).read_text()).get("trainer", {}).get("batch", {}).get("max_k3")
    runs = []
    for i in range(a.runs):
        run_dir = out / f"run{i + 1}"
        runs.append(summarize(run_dir, run_once(conf, run_dir, sys.executable)))
        r = runs[-1]
        print(
            f"run {i + 1}: held-out {r['v0']:.3f} -> {r['final']:.3f} ({r['gain_points']:+.1f} points) in "
            f"{r['versions']} versions, k3 mean {r['k3_mean'] or 0:.4f} max {r['k3_max'] or 0:.4f}, "
            f"train {r['train_s']:.0f} s + eval {r['eval_s']:.0f} s",
            flush=True,
        )
    result = {
        "config": a.config,
        "steps": a.steps,
        "minutes": a.minutes,
        "max_k3": k3_target,
        "runs": runs,
        "spread": spread(runs),
        "out": str(out),
    }
    if a.plot:
        plot(runs, Path(a.plot), k3_target)
        result["plot"] = a.plot
    if a.json:
        print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
