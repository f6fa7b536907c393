"""`asyncrl cost-demo`: does the cost penalty make answers cheaper, and what does it cost in success?

    asyncrl cost-demo [--config deploy/demo.toml] [--out runs/cost-demo] [--baseline RUN_DIR]
    asyncrl cost-demo --seeds 0,1,2 [--lambda-scale 0.5]     # both arms per seed, mean ± std

1. λ = 0: `asyncrl up` on the config (or reuse a finished run with --baseline);
2. λ from the model's own test-time scaling curve: `asyncrl calibrate-cost` on the policy that
   RL started from (the run's warmstart.pt), tangent at the operating point (--axis/--budget);
3. the same run again with `--lambda λ` (same seed, same warm start, same tasks);
4. held-out success and tokens per answer of both, side by side: compare.json and compare.png.

Success is reported as the mean over every eval after version 0 (one eval of 256 prompts has
σ ≈ 0.02-0.03) and, with --seeds, as mean ± std over seeds (the trainer seed sets the model's
initialisation and its warm start; each seed's two arms share both).
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
    """Initial and final held-out numbers; final = mean of the last `last` evals (one eval is noisy);
    `*_mean_evals`: mean over every eval after the first (the whole RL run, not its last point)."""
    tail, rl = curve[-last:], curve[1:] or curve
    return {"success_initial": curve[0]["success"], "tokens_initial": curve[0]["tokens"],
            "success_final": sum(c["success"] for c in tail) / len(tail),
            "tokens_final": sum(c["tokens"] for c in tail) / len(tail), "final_versions": [c["version"] for c in tail],
            "success_mean_evals": sum(c["success"] for c in rl) / len(rl),
            "tokens_mean_evals": sum(c["tokens"] for c in rl) / len(rl)}


def config_for_seed(text: str, seed: int) -> str:
    """The run config with `seed = N` in its [trainer] table (replacing one that is there)."""
    lines, out, in_trainer, done = text.splitlines(), [], False, False
    for line in lines:
        head = line.strip()
        if head.startswith("["):
            if in_trainer and not done:
                out.append(f"seed = {seed}")
                done = True
            in_trainer = head == "[trainer]"
        elif in_trainer and head.split("=")[0].strip() == "seed":
            line, done = f"seed = {seed}", True
        out.append(line)
    if in_trainer and not done:
        out.append(f"seed = {seed}")
    elif not done:
        out += ["[trainer]", f"seed = {seed}"]
    return "\n".join(out) + "\n"


def mean_std(xs: list[float]) -> dict:
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return {"mean": m, "std": sd, "n": len(xs), "values": xs}


def across_seeds(per_seed: list[dict]) -> dict:
    """Both arms' success (mean over evals) and tokens, and their paired differences, over seeds."""
    pick = lambda arm, k: [r[arm][k] for r in per_seed]
    diff = [r["calibrated"]["success_mean_evals"] - r["lambda0"]["success_mean_evals"] for r in per_seed]
    ratio = [r["calibrated"]["tokens_mean_evals"] / r["lambda0"]["tokens_mean_evals"] for r in per_seed]
    return {"success_lambda0": mean_std(pick("lambda0", "success_mean_evals")),
            "success_calibrated": mean_std(pick("calibrated", "success_mean_evals")),
            "tokens_lambda0": mean_std(pick("lambda0", "tokens_mean_evals")),
            "tokens_calibrated": mean_std(pick("calibrated", "tokens_mean_evals")),
            "success_diff": mean_std(diff), "tokens_ratio": mean_std(ratio),
            "lambda": mean_std([r["lambda"] for r in per_seed])}


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    """One line per curve; labels ending in ' #k' (seed k of an arm) share the arm's colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    colours: dict[str, str] = {}
    for label, c in curves.items():
        arm = label.split(" #")[0]
        first = arm not in colours
        colour = colours.setdefault(arm, f"C{len(colours)}")
        v = [p["version"] for p in c]
        kw = dict(color=colour, label=arm if first else None, alpha=1.0 if first else 0.6)
        a1.plot(v, [p["success"] for p in c], "o-", **kw)
        a2.plot(v, [p["tokens"] for p in c], "o-", **kw)
    a1.set(title="held-out success", xlabel="policy version", ylim=(0, 1))
    a2.set(title="tokens per answer (held-out)", xlabel="policy version")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def one_seed(a, config: str, out: Path, env: str, max_tokens: int, baseline: str | None) -> tuple[dict, dict]:
    """λ = 0 run (or `baseline`), calibration, the λ run -> (result, curves)."""
    out.mkdir(parents=True, exist_ok=True)
    base = Path(baseline) if baseline else out / "lambda0"
    if not baseline:
        up(config, base, ["--lambda", "0"])
    if not (base / "warmstart.pt").exists():
        raise FileNotFoundError(f"{base}/warmstart.pt missing (did the run warm-start?)")
    cal = calibrate(base, env, a.axis, a.budget, max_tokens, a.prompts, out / "calibrate.png")
    lam = float(cal["lambda"]) * a.lambda_scale
    priced = out / "calibrated"
    up(config, priced, ["--lambda", repr(lam)])
    c0, c1 = eval_curve(base), eval_curve(priced)
    result = {"lambda": lam, "lambda_scale": a.lambda_scale,
              "calibration": {k: cal[k] for k in ("lambda", "operating_cost", "operating_point", "axis", "fit")},
              "lambda0": summarize(c0), "calibrated": summarize(c1),
              "runs": {"lambda0": str(base), "calibrated": str(priced)}}
    r0, r1 = result["lambda0"], result["calibrated"]
    result["tokens_ratio"] = r1["tokens_final"] / r0["tokens_final"]
    result["success_diff"] = r1["success_final"] - r0["success_final"]
    result["success_diff_mean_evals"] = r1["success_mean_evals"] - r0["success_mean_evals"]
    return result, {"λ = 0": c0, f"λ = {lam:.5f}": c1}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl cost-demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deploy/demo.toml")
    ap.add_argument("--out", default="runs/cost-demo")
    ap.add_argument("--baseline", default=None, help="a finished λ = 0 run dir of the same config (skips step 1)")
    ap.add_argument("--env", default=None, help="calibration env (default: the config's first trainer env)")
    ap.add_argument("--axis", choices=("tokens", "samples"), default="samples")
    ap.add_argument("--budget", type=int, default=1, help="operating point on the axis (1 sample per task)")
    ap.add_argument("--lambda-scale", type=float, default=1.0,
                    help="λ = scale × the measured tangent slope (below 1: pay less for tokens, keep more success)")
    ap.add_argument("--seeds", default=None, help="comma-separated trainer seeds: both arms per seed")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the config's task max_tokens")
    ap.add_argument("--prompts", type=int, default=128)
    a = ap.parse_args(argv)

    import tomllib
    text = Path(a.config).read_text()
    tr = tomllib.loads(text).get("trainer", {})
    env = a.env or tr.get("envs", ["arith"])[0]
    max_tokens = a.max_tokens or int(tr.get("task_sampling", {}).get("max_tokens", 48))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else None
    if seeds and a.baseline:
        print("asyncrl cost-demo: --baseline is one run; it cannot stand for several --seeds", file=sys.stderr)
        return 2
    try:
        if not seeds:
            result, curves = one_seed(a, a.config, out, env, max_tokens, a.baseline)
        else:
            per_seed, curves = [], {}
            for sd in seeds:
                d = out / f"seed{sd}"
                d.mkdir(parents=True, exist_ok=True)
                cfg = d / "config.toml"
                cfg.write_text(config_for_seed(text, sd))
                r, c = one_seed(a, str(cfg), d, env, max_tokens, None)
                per_seed.append({"seed": sd, **r})
                curves.update({f"{k.split(' = ')[0]} = {'0' if k == 'λ = 0' else 'calibrated'} #{sd}": v
                               for k, v in c.items()})
            result = {"seeds": seeds, "per_seed": per_seed, **across_seeds(per_seed)}
    except FileNotFoundError as e:
        print(f"asyncrl cost-demo: {e}", file=sys.stderr)
        return 2
    plot(curves, out / "compare.png")
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    if seeds:
        s0, s1, r = result["success_lambda0"], result["success_calibrated"], result["tokens_ratio"]
        print(f"{len(seeds)} seeds: held-out success (mean over evals) {s0['mean']:.3f} ± {s0['std']:.3f} (λ=0) vs "
              f"{s1['mean']:.3f} ± {s1['std']:.3f}; tokens {r['mean']:.2f}x -> {out}/compare.png", file=sys.stderr)
    else:
        r0, r1 = result["lambda0"], result["calibrated"]
        print(f"λ = {result['lambda']:.5f}: held-out success {r0['success_final']:.3f} (λ=0) vs "
              f"{r1['success_final']:.3f}, tokens per answer {r0['tokens_final']:.1f} vs {r1['tokens_final']:.1f} "
              f"({result['tokens_ratio']:.2f}x)  -> {out}/compare.png", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
