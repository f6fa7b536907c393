"""`asyncrl cost-demo`: does the cost penalty make answers cheaper, and what does it cost in success?

    asyncrl cost-demo [--config deploy/demo.toml] [--out runs/cost-demo] [--baseline RUN_DIR]
    asyncrl cost-demo --seeds 0,1,2 [--lambda-scale 0.5]     # both arms per seed, mean ± std
    asyncrl cost-demo --seeds 0,1,2 --arms lambda0,calibrated,success_only,group_normalised,ramp,budget
    asyncrl cost-demo --config deploy/cost-swe-demo.toml --axis samples --budget 1 --prompts 36 --seeds 0,1
                                                             # episodes: resolved − λ·cost

Arms (each a full run from the λ = 0 run's warm start, same seed and tasks; λ_cal = the tangent λ):
    lambda0           λ = 0
    calibrated        λ_cal, linear penalty (the scorer's success − λ·cost)
    success_only      λ_cal, [trainer.cost] penalty = "success_only"
    group_normalised  λ_cal, [trainer.cost] penalty = "group_normalised"
    ramp              [trainer.cost] schedule = "ramp": 0 -> λ_cal over --ramp-versions versions
    budget            [trainer.cost] schedule = "budget": λ from 0, dual ascent to --budget-tokens
                      (default --budget-ratio × the λ = 0 run's held-out tokens per answer)

1. λ = 0: `asyncrl up` on the config (or reuse a finished run with --baseline);
2. λ from the model's own test-time scaling curve: `asyncrl calibrate-cost` on the policy that
   RL started from (the run's warmstart.pt), tangent at the operating point (--axis/--budget);
3. the same run again with `--lambda λ` (same seed, same warm start, same tasks);
4. held-out success and tokens per answer of every arm, side by side: compare.json, compare.png
   (curves per version) and tradeoff.png (success against tokens per answer, one point per arm and seed).

Each arm is also judged by the objective itself, held-out success − λ·cost at the arm's λ, with the
success rate and the cost per success apart (an episode's cost: the policy's tokens, eval_model_tokens).
`--reuse` keeps a seed's finished λ = 0 run found in --out (seedN/lambda0).

Success is reported as the mean over every eval after version 0 (one eval of 256 prompts has
σ ≈ 0.02-0.03) and, with --seeds, as mean ± std over seeds (the trainer seed sets the model's
initialisation and its warm start; each seed's two arms share both).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import click
import tomli_w

from asyncrl.report import read_trainer_metrics
from kernel.cli import Command, run


def up(config: str, run_dir: Path, extra: list[str]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "up",
        "--config",
        config,
        "--run-dir",
        str(run_dir),
        "--quiet",
        *extra,
    ]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def calibrate(
    run_dir: Path,
    env: str,
    axis: str,
    budget: int,
    max_tokens: int,
    prompts: int,
    out: Path,
    temperature: float = 1.0,
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "calibrate-cost",
        "--checkpoint",
        str(run_dir / "warmstart.pt"),
        "--env",
        env,
        "--axis",
        axis,
        "--budget",
        str(budget),
        "--max-tokens",
        str(max_tokens),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--temperature",
        repr(temperature),
    ]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def eval_curve(run_dir: Path) -> list[dict]:
    """Held-out evals by version. Sorted: the after-run evals (`[up] final_eval`) append the last
    version's eval before the initial one's."""
    rows = [  # an episode's cost is its policy tokens (eval_model_tokens), not its whole context
        {
            "version": r["version"],
            "success": r["eval_success"],
            "tokens": r.get("eval_model_tokens", r["eval_tokens"]),
        }
        for r in read_trainer_metrics(run_dir)
        if r.get("eval_success") is not None
    ]
    return sorted(rows, key=lambda c: c["version"])


def summarize(curve: list[dict], last: int = 3) -> dict:
    """Initial and final held-out numbers; final = mean of the last `last` evals (one eval is noisy);
    `*_mean_evals`: mean over every eval after the first (the whole RL run, not its last point).
    The initial eval is never part of `final` (a run with only the after-run evals has two)."""
    rl = curve[1:] or curve
    tail = rl[-last:]
    return {
        "success_initial": curve[0]["success"],
        "tokens_initial": curve[0]["tokens"],
        "success_final": sum(c["success"] for c in tail) / len(tail),
        "tokens_final": sum(c["tokens"] for c in tail) / len(tail),
        "final_versions": [c["version"] for c in tail],
        "success_mean_evals": sum(c["success"] for c in rl) / len(rl),
        "tokens_mean_evals": sum(c["tokens"] for c in rl) / len(rl),
    }


ARMS = ("lambda0", "calibrated", "success_only", "group_normalised", "ramp", "budget")


def config_for_seed(text: str, seed: int) -> str:
    """The run config with `seed = N` in its [trainer.run] section (replacing one that is there)."""
    return config_with(text, {"run": {"seed": seed}})


def config_with(text: str, trainer: dict) -> str:
    """The run config with these [trainer] keys set (replacing those that are there). A dict value
    holds a section's keys ({"cost": {"penalty": "success_only"}}), merged into [trainer.<section>].
    The copy is written anew by tomli_w: the original's comments are not kept."""
    conf = tomllib.loads(text)
    t = conf.setdefault("trainer", {})
    for k, v in trainer.items():
        t[k] = {**t.get(k, {}), **v} if isinstance(v, dict) else v
    return tomli_w.dumps(conf)


def arm_setup(arm: str, lam_cal: float, base: Path, tokens0: float, a) -> tuple[list[str], dict]:
    """(extra `asyncrl up` args, [trainer] keys) of one arm; each starts from the λ = 0 run's warm start."""
    # the λ = 0 run's warm start when it made one; else every arm starts from the config's own
    # initial weights (a pretrained model without a warm start: SmolLM2), same seed
    start = {"warmstart": {"reuse": str(base / "warmstart.pt")}} if (base / "warmstart.pt").exists() else {}
    if arm == "calibrated":
        return ["--lambda", repr(lam_cal)], start
    if arm in ("success_only", "group_normalised"):
        return ["--lambda", repr(lam_cal)], {**start, "cost": {"penalty": arm}}
    if arm == "ramp":
        return ["--lambda", "0"], {
            **start,
            "cost": {"schedule": "ramp", "target": lam_cal, "ramp_versions": a.ramp_versions},
        }
    if arm == "budget":
        budget = a.budget_tokens or a.budget_ratio * tokens0
        return ["--lambda", "0"], {
            **start,
            "cost": {"schedule": "budget", "budget_tokens": budget, "budget_lr": a.budget_lr},
        }
    raise ValueError(f"unknown arm {arm!r} (one of {ARMS})")


def objective(summary: dict, lam: float) -> dict:
    """What the penalty optimises, judged on held-out evals (means over the run's evals after v0):
    success − λ·cost at the given λ, and, apart, the success rate and the cost per success."""
    s, c = summary["success_mean_evals"], summary["tokens_mean_evals"]
    return {
        "lambda": lam,
        "value": s - lam * c,
        "success": s,
        "cost": c,
        "cost_per_success": c / s if s > 0 else None,
    }


def lambda_path(run_dir: Path) -> list[dict]:
    """How λ moved in a run: per version, the mean λ its groups were scored with and the value set next."""
    return [
        {
            "version": r["version"],
            "lambda": r.get("lambda"),
            "lambda_next": r.get("lambda_next"),
            "tokens_per_answer": r.get("tokens_per_answer"),
        }
        for r in read_trainer_metrics(run_dir)
        if "samples" in r
    ]


def worst_gap(base: list[dict], arm: list[dict], after: int = 25) -> float | None:
    """The largest drop of the arm's held-out success below λ = 0's at the same version, after `after`."""
    b = {c["version"]: c["success"] for c in base}
    gaps = [b[c["version"]] - c["success"] for c in arm if c["version"] > after and c["version"] in b]
    return max(gaps) if gaps else None


def mean_std(xs: list[float]) -> dict:
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return {"mean": m, "std": sd, "n": len(xs), "values": xs}


def across_seeds(per_seed: list[dict]) -> dict:
    """Every arm's success (mean over evals) and tokens, and their differences paired with λ = 0 by
    seed, over seeds: success_<arm>, tokens_<arm>, success_diff_<arm>, tokens_ratio_<arm>
    (the calibrated arm's also as success_diff / tokens_ratio)."""
    pick = lambda arm, k: [r[arm][k] for r in per_seed]  # noqa: E731
    arms = [a for a in ARMS if all(a in r for r in per_seed)]
    out = {
        f"{k}_{arm}": mean_std(pick(arm, f"{k}_mean_evals")) for arm in arms for k in ("success", "tokens")
    }
    s0, t0 = pick("lambda0", "success_mean_evals"), pick("lambda0", "tokens_mean_evals")
    for arm in arms[1:]:
        s1, t1 = pick(arm, "success_mean_evals"), pick(arm, "tokens_mean_evals")
        out[f"success_diff_{arm}"] = mean_std([b - a for a, b in zip(s0, s1)])
        out[f"tokens_ratio_{arm}"] = mean_std([b / a for a, b in zip(t0, t1)])
    value = lambda r, arm: objective(r[arm], r["lambda"])["value"]  # noqa: E731
    for arm in arms:  # the objective itself: held-out success − λ·cost at the seed's λ
        out[f"objective_{arm}"] = mean_std([value(r, arm) for r in per_seed])
        if arm != "lambda0":
            out[f"objective_diff_{arm}"] = mean_std([value(r, arm) - value(r, "lambda0") for r in per_seed])
    if "calibrated" in arms:
        out["success_diff"] = out["success_diff_calibrated"]
        out["tokens_ratio"] = out["tokens_ratio_calibrated"]
    out["arms"] = arms
    out["lambda"] = mean_std([r["lambda"] for r in per_seed])
    return out


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
    """λ = 0 run (or `baseline`), calibration, one run per other arm -> (result, curves by arm)."""
    out.mkdir(parents=True, exist_ok=True)
    base = Path(baseline) if baseline else out / "lambda0"
    if not baseline:
        up(config, base, ["--lambda", "0"])
    if a.lambda_cal is not None:  # measured elsewhere (calibrate-cost on the model RL starts from)
        cal = {
            "lambda": a.lambda_cal,
            "operating_cost": None,
            "operating_point": None,
            "axis": a.axis,
            "fit": None,
            "given": True,
        }
    elif not (base / "warmstart.pt").exists():
        raise FileNotFoundError(
            f"{base}/warmstart.pt missing (did the run warm-start? without one, "
            f"give the tangent λ with --lambda-cal)"
        )
    else:
        cal = calibrate(
            base, env, a.axis, a.budget, max_tokens, a.prompts, out / "calibrate.png", a.calibrate_temperature
        )
    lam = float(cal["lambda"]) * a.lambda_scale
    c0 = eval_curve(base)
    if not c0:
        raise FileNotFoundError(f"{base}: no held-out evals in its metrics (eval_every = 0?)")
    text = Path(config).read_text()
    result = {
        "lambda": lam,
        "lambda_scale": a.lambda_scale,
        "calibration": {k: cal[k] for k in ("lambda", "operating_cost", "operating_point", "axis", "fit")},
        "lambda0": {**summarize(c0), "objective": objective(summarize(c0), lam)},
        "runs": {"lambda0": str(base)},
        "lambda_paths": {},
    }
    curves = {"lambda0": c0}
    for arm in [x for x in a.arm_list if x != "lambda0"]:
        extra, keys = arm_setup(arm, lam, base, result["lambda0"]["tokens_mean_evals"], a)
        arm_cfg = out / f"{arm}.toml"
        arm_cfg.write_text(config_with(text, keys))
        run = out / arm
        up(str(arm_cfg), run, extra)
        curves[arm] = eval_curve(run)
        r0, r1 = result["lambda0"], summarize(curves[arm])
        result[arm] = {
            **r1,
            "tokens_ratio": r1["tokens_mean_evals"] / r0["tokens_mean_evals"],
            "success_diff_mean_evals": r1["success_mean_evals"] - r0["success_mean_evals"],
            "worst_gap_after_v25": worst_gap(c0, curves[arm]),
            "objective": objective(r1, lam),
            "trainer": keys,
            "up_args": extra,
        }
        result["runs"][arm] = str(run)
        result["lambda_paths"][arm] = lambda_path(run)
    if "calibrated" in result:  # the two-arm numbers as before
        r0, r1 = result["lambda0"], result["calibrated"]
        result["tokens_ratio"] = r1["tokens_final"] / r0["tokens_final"]
        result["success_diff"] = r1["success_final"] - r0["success_final"]
        result["success_diff_mean_evals"] = r1["success_mean_evals"] - r0["success_mean_evals"]
    return result, curves


def plot_tradeoff(points: dict[str, list[tuple[float, float]]], path: Path) -> None:
    """Held-out success against tokens per answer (means over each run's evals): one marker per arm and
    seed, the arm's mean over seeds larger."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for i, (arm, pts) in enumerate(points.items()):
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.scatter(xs, ys, color=f"C{i}", alpha=0.5, s=25)
        ax.scatter([sum(xs) / len(xs)], [sum(ys) / len(ys)], color=f"C{i}", s=110, edgecolor="k", label=arm)
    ax.set(
        title="success against cost (held-out evals after v0)",
        xlabel="cost: policy tokens per answer or episode",
        ylabel="held-out success",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@click.command("cost-demo", cls=Command, help=__doc__)
@click.option("--config", default="deploy/demo.toml")
@click.option("--out", default="runs/cost-demo")
@click.option("--baseline", default=None, help="a finished λ = 0 run dir of the same config (skips step 1)")
@click.option("--env", default=None, help="calibration env (default: the config's first trainer env)")
@click.option(
    "--axis",
    type=click.Choice(("tokens", "samples", "turns")),
    default="samples",
    help="calibration budgets (sampled at the config's temperature): max tokens, samples per task"
    " (episodes on a multi-turn env), or an episode's turns",
)
@click.option("--budget", type=int, default=1, help="operating point on the axis (1 sample per task)")
@click.option(
    "--lambda-scale",
    type=float,
    default=1.0,
    help="λ = scale × the measured tangent slope (below 1: pay less for tokens, keep more success)",
)
@click.option("--seeds", default=None, help="comma-separated trainer seeds: both arms per seed")
@click.option(
    "--reuse",
    is_flag=True,
    help="with --seeds: a seed's finished λ = 0 run in --out (seedN/lambda0, with its evals) is kept",
)
@click.option("--max-tokens", type=int, default=None, help="default: the config's task max_tokens")
@click.option("--prompts", type=int, default=128)
@click.option(
    "--lambda-cal",
    type=float,
    default=None,
    help="the tangent λ, measured already: no calibration (needed without a warm start)",
)
@click.option("--arms", default="lambda0,calibrated", help=f"comma-separated, from {','.join(ARMS)}")
@click.option("--ramp-versions", type=int, default=25, help="ramp arm: versions from λ = 0 to λ_cal")
@click.option(
    "--budget-tokens",
    type=float,
    default=0.0,
    help="budget arm: tokens per answer aimed at (default: --budget-ratio × λ = 0's)",
)
@click.option("--budget-ratio", type=float, default=0.6)
@click.option(
    "--budget-lr", type=float, default=0.002, help="budget arm: λ's step per version at 2× the budget"
)
def cli(**flags) -> int:
    a = SimpleNamespace(**flags)
    a.arm_list = [x.strip() for x in a.arms.split(",") if x.strip()]
    if bad := [x for x in a.arm_list if x not in ARMS]:
        print(f"asyncrl cost-demo: unknown arm(s) {bad}; arms are {', '.join(ARMS)}", file=sys.stderr)
        return 2
    if "lambda0" not in a.arm_list:
        a.arm_list.insert(0, "lambda0")  # every comparison is against λ = 0
    if (
        a.ramp_versions < 1
        or a.budget_lr <= 0
        or a.budget_ratio <= 0
        or a.budget_tokens < 0
        or (a.lambda_cal is not None and not a.lambda_cal >= 0)
    ):
        print(
            "asyncrl cost-demo: needs --ramp-versions >= 1, --budget-lr > 0, --budget-ratio > 0, "
            "--budget-tokens >= 0, --lambda-cal >= 0",
            file=sys.stderr,
        )
        return 2

    text = Path(a.config).read_text()
    tr = tomllib.loads(text).get("trainer", {})
    env = a.env or tr.get("tasks", {}).get("envs", ["arith"])[0]
    sampling = tr.get("tasks", {}).get("sampling", {})
    max_tokens = a.max_tokens or int(sampling.get("max_tokens", 48))
    a.calibrate_temperature = float(sampling.get("temperature", 1.0))  # the curve where the run samples
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else None
    if seeds and a.baseline:
        print(
            "asyncrl cost-demo: --baseline is one run; it cannot stand for several --seeds", file=sys.stderr
        )
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
                done = a.reuse and (d / "lambda0" / "warmstart.pt").exists() and eval_curve(d / "lambda0")
                r, c = one_seed(a, str(cfg), d, env, max_tokens, str(d / "lambda0") if done else None)
                per_seed.append({"seed": sd, **r})
                curves.update({f"{arm} #{sd}": v for arm, v in c.items()})
            result = {"seeds": seeds, "per_seed": per_seed, **across_seeds(per_seed)}
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        print(f"asyncrl cost-demo: {e}", file=sys.stderr)
        return 2
    plot(curves, out / "compare.png")
    runs = result["per_seed"] if seeds else [result]
    points = {
        arm: [(r[arm]["tokens_mean_evals"], r[arm]["success_mean_evals"]) for r in runs]
        for arm in a.arm_list
        if all(arm in r for r in runs)
    }
    plot_tradeoff(points, out / "tradeoff.png")
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    for arm in a.arm_list:
        if seeds:
            s_, t_, o_ = result[f"success_{arm}"], result[f"tokens_{arm}"], result[f"objective_{arm}"]
            print(
                f"{arm:>16}: held-out success (mean over evals, {len(seeds)} seeds) {s_['mean']:.3f} ± "
                f"{s_['std']:.3f}, tokens per answer {t_['mean']:.1f} ± {t_['std']:.1f}, "
                f"success − λ·cost {o_['mean']:.3f} ± {o_['std']:.3f}",
                file=sys.stderr,
            )
        else:
            r = result[arm]
            print(
                f"{arm:>16}: held-out success (mean over evals) {r['success_mean_evals']:.3f}, "
                f"tokens per answer {r['tokens_mean_evals']:.1f}, "
                f"success − λ·cost {r['objective']['value']:.3f}",
                file=sys.stderr,
            )
    print(
        f"λ_cal = {result['lambda']['mean'] if seeds else result['lambda']:.5f} -> {out}/compare.json, "
        f"{out}/compare.png, {out}/tradeoff.png",
        file=sys.stderr,
    )
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "asyncrl cost-demo")


if __name__ == "__main__":
    sys.exit(main())
