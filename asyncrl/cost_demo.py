"""`asyncrl cost-demo`: does the cost penalty make answers cheaper at the same success?

    asyncrl cost-demo [--config deploy/demo.toml] [--out runs/cost-demo] [--baseline RUN_DIR]

1. λ = 0: `asyncrl up` on the config (or reuse a finished run with --baseline);
2. λ from the model's own test-time scaling curve: `asyncrl calibrate-cost` on the policy that
   RL started from (the run's warmstart.pt), tangent at the operating point (--axis/--budget);
3. the same run again with `--lambda λ` (same seed, same warm start, same tasks);
4. held-out success and tokens per answer of both, side by side: compare.json and compare.png.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .report import read_trainer_metrics


def up(config: str, run_dir: Path, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "asyncrl.cli", "up", "--config", config, "--run-dir", str(run_dir), "--quiet", *extra]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def calibrate(run_dir: Path, env: str, axis: str, budget: int, max_tokens: int, prompts: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "asyncrl.cli", "calibrate-cost", "--checkpoint", str(run_dir / "warmstart.pt"),
           "--env", env, "--axis", axis, "--budget", str(budget), "--max-tokens", str(max_tokens),
           "--prompts", str(prompts), "--out", str(out)]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def eval_curve(run_dir: Path) -> list[dict]:
    return [{"version": r["version"], "success": r["eval_success"], "tokens": r["eval_tokens"]}
            for r in read_trainer_metrics(run_dir) if r.get("eval_success") is not None]


def summarize(curve: list[dict], last: int = 3) -> dict:
    """Initial and final held-out numbers; final = mean of the last `last` evals (one eval is noisy)."""
    tail = curve[-last:]
    return {"success_initial": curve[0]["success"], "tokens_initial": curve[0]["tokens"],
            "success_final": sum(c["success"] for c in tail) / len(tail),
            "tokens_final": sum(c["tokens"] for c in tail) / len(tail), "final_versions": [c["version"] for c in tail]}


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, c in curves.items():
        v = [p["version"] for p in c]
        a1.plot(v, [p["success"] for p in c], "o-", label=label)
        a2.plot(v, [p["tokens"] for p in c], "o-", label=label)
    a1.set(title="held-out success", xlabel="policy version", ylim=(0, 1))
    a2.set(title="tokens per answer (held-out)", xlabel="policy version")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl cost-demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deploy/demo.toml")
    ap.add_argument("--out", default="runs/cost-demo")
    ap.add_argument("--baseline", default=None, help="a finished λ = 0 run dir of the same config (skips step 1)")
    ap.add_argument("--env", default=None, help="calibration env (default: the config's first trainer env)")
    ap.add_argument("--axis", choices=("tokens", "samples"), default="samples")
    ap.add_argument("--budget", type=int, default=1, help="operating point on the axis (1 sample per task)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the config's task max_tokens")
    ap.add_argument("--prompts", type=int, default=128)
    a = ap.parse_args(argv)

    import tomllib
    conf = tomllib.loads(Path(a.config).read_text())
    tr = conf.get("trainer", {})
    env = a.env or tr.get("envs", ["arith"])[0]
    max_tokens = a.max_tokens or int(tr.get("task_sampling", {}).get("max_tokens", 48))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    base = Path(a.baseline) if a.baseline else out / "lambda0"
    if not a.baseline:
        up(a.config, base, ["--lambda", "0"])
    if not (base / "warmstart.pt").exists():
        print(f"asyncrl cost-demo: {base}/warmstart.pt missing (did the run warm-start?)", file=sys.stderr)
        return 2
    cal = calibrate(base, env, a.axis, a.budget, max_tokens, a.prompts, out / "calibrate.png")
    lam = float(cal["lambda"])
    priced = out / "calibrated"
    up(a.config, priced, ["--lambda", repr(lam)])

    curves = {"λ = 0": eval_curve(base), f"λ = {lam:.5f} (calibrated)": eval_curve(priced)}
    result = {"lambda": lam, "calibration": {k: cal[k] for k in ("operating_cost", "operating_point", "axis", "fit")},
              "lambda0": summarize(curves["λ = 0"]), "calibrated": summarize(list(curves.values())[1]),
              "runs": {"lambda0": str(base), "calibrated": str(priced)}}
    r0, r1 = result["lambda0"], result["calibrated"]
    result["tokens_ratio"] = r1["tokens_final"] / r0["tokens_final"]
    result["success_diff"] = r1["success_final"] - r0["success_final"]
    plot(curves, out / "compare.png")
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    print(f"λ = {lam:.5f}: held-out success {r0['success_final']:.3f} (λ=0) vs {r1['success_final']:.3f}, "
          f"tokens per answer {r0['tokens_final']:.1f} vs {r1['tokens_final']:.1f} "
          f"({result['tokens_ratio']:.2f}x)  -> {out}/compare.png", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
