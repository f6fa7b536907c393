"""asyncrl cost-demo: the comparison it draws from two runs' held-out evals."""

import json

import pytest

from asyncrl import cost_demo
from asyncrl.report import read_trainer_metrics


def _run(tmp_path, name, evals):
    d = tmp_path / name / "metrics"
    d.mkdir(parents=True)
    rows = [{"version": v, "eval_success": s, "eval_tokens": t, "ts": float(v)} for v, s, t in evals]
    rows.insert(1, {"version": 1, "samples": 16, "ts": 1.0})  # step rows are not evals
    (d / "trainer.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return tmp_path / name


def arm(s, t):
    """One arm's summary, as cost_demo.summarize gives it: mean success and tokens over its evals."""
    return {"success_mean_evals": s, "tokens_mean_evals": t}


def test_summary_uses_the_first_eval_and_the_mean_of_the_last_three(tmp_path):
    run = _run(
        tmp_path, "a", [(0, 0.2, 20.0), (25, 0.5, 30.0), (50, 0.6, 32.0), (75, 0.7, 34.0), (100, 0.8, 36.0)]
    )
    curve = cost_demo.eval_curve(run)
    assert [c["version"] for c in curve] == [0, 25, 50, 75, 100]
    s = cost_demo.summarize(curve)
    assert s["success_initial"] == 0.2 and s["tokens_initial"] == 20.0
    assert abs(s["success_final"] - 0.7) < 1e-9 and abs(s["tokens_final"] - 34.0) < 1e-9
    assert s["final_versions"] == [50, 75, 100]


def test_after_run_evals_written_last_first_are_read_in_version_order(tmp_path):
    """`[up] final_eval` appends the last version's eval before the initial one's (SmolLM2 runs):
    read in file order, v41 was taken for the starting point and v0 for the result."""
    run = _run(tmp_path, "a", [(41, 0.92, 9.7), (0, 0.41, 17.2)])
    s = cost_demo.summarize(cost_demo.eval_curve(run))
    assert s["success_initial"] == 0.41 and s["success_mean_evals"] == 0.92 and s["tokens_mean_evals"] == 9.7
    # "final" is the last version's eval, not the mean of it and the starting point
    assert s["success_final"] == 0.92 and s["tokens_final"] == 9.7 and s["final_versions"] == [41]


def test_plot_writes_a_png(tmp_path):
    a = cost_demo.eval_curve(_run(tmp_path, "a", [(0, 0.2, 20.0), (25, 0.5, 30.0)]))
    b = cost_demo.eval_curve(_run(tmp_path, "b", [(0, 0.2, 20.0), (25, 0.5, 18.0)]))
    cost_demo.plot({"λ = 0": a, "λ = 0.004": b}, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_warm_start_is_a_clear_error(tmp_path, capsys):
    base = _run(tmp_path, "base", [(0, 0.2, 20.0)])
    cfg = tmp_path / "c.toml"
    cfg.write_text('[trainer.tasks]\nenvs = ["arith-small"]\n')
    assert cost_demo.main(["--config", str(cfg), "--baseline", str(base), "--out", str(tmp_path / "o")]) == 2
    assert "warmstart.pt missing" in capsys.readouterr().err


def test_mean_over_evals_excludes_version_0():
    s = cost_demo.summarize(
        [
            {"version": 0, "success": 0.2, "tokens": 20.0},
            {"version": 25, "success": 0.6, "tokens": 30.0},
            {"version": 50, "success": 0.8, "tokens": 40.0},
        ]
    )
    assert abs(s["success_mean_evals"] - 0.7) < 1e-9 and abs(s["tokens_mean_evals"] - 35.0) < 1e-9


def test_config_for_seed_sets_the_trainer_seed_only():
    import tomllib

    text = "[up]\nsteps = 5\n[trainer.optim]\nlr = 1e-3\n[trainer.run]\nseed = 7\n[worker.engine]\nseed = 3\n"
    conf = tomllib.loads(cost_demo.config_for_seed(text, 2))
    assert conf["trainer"]["run"]["seed"] == 2 and conf["worker"]["engine"]["seed"] == 3
    assert conf["up"]["steps"] == 5
    conf = tomllib.loads(
        cost_demo.config_for_seed("[trainer.optim]\nlr = 1e-3\n[worker.engine]\nslots = 2\n", 4)
    )
    assert conf["trainer"] == {"optim": {"lr": 1e-3}, "run": {"seed": 4}}
    assert tomllib.loads(cost_demo.config_for_seed("[up]\nsteps = 1\n", 1))["trainer"]["run"]["seed"] == 1


def test_across_seeds_pairs_the_arms():
    per = [
        {"lambda": 0.01, "lambda0": arm(0.8, 40.0), "calibrated": arm(0.78, 20.0)},
        {"lambda": 0.02, "lambda0": arm(0.9, 40.0), "calibrated": arm(0.86, 24.0)},
    ]
    r = cost_demo.across_seeds(per)
    assert abs(r["success_diff"]["mean"] + 0.03) < 1e-9 and abs(r["tokens_ratio"]["mean"] - 0.55) < 1e-9
    assert r["success_lambda0"]["n"] == 2 and r["success_lambda0"]["std"] > 0


def test_seeds_and_baseline_do_not_mix(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[trainer.tasks]\nenvs = ["arith-small"]\n')
    assert (
        cost_demo.main(
            ["--config", str(cfg), "--baseline", "x", "--seeds", "0,1", "--out", str(tmp_path / "o")]
        )
        == 2
    )
    assert "--baseline" in capsys.readouterr().err


# -- arms -------------------------------------------------------------------------------------------


def test_config_with_sets_trainer_keys_and_keeps_the_rest():
    import tomllib

    text = (
        '[up]\nsteps = 5\n[trainer.optim]\nlr = 1e-3\n[trainer.cost]\npenalty = "linear"\n'
        "[worker.engine]\nslots = 2\n"
    )
    conf = tomllib.loads(
        cost_demo.config_with(
            text,
            {
                "cost": {"penalty": "success_only", "target": 0.004, "ramp_versions": 10},
                "warmstart": {"reuse": "/r/w.pt"},
            },
        )
    )
    assert conf["trainer"] == {
        "optim": {"lr": 1e-3},
        "warmstart": {"reuse": "/r/w.pt"},
        "cost": {"penalty": "success_only", "target": 0.004, "ramp_versions": 10},
    }
    assert conf["worker"] == {"engine": {"slots": 2}} and conf["up"] == {"steps": 5}
    assert tomllib.loads(cost_demo.config_with("[up]\nsteps = 1\n", {"cost": {"budget_tokens": 12.5}}))[
        "trainer"
    ] == {"cost": {"budget_tokens": 12.5}}


def test_each_arm_is_a_valid_trainer_config(tmp_path):
    import argparse

    from trainer.config import TrainerConfig

    (tmp_path / "warmstart.pt").write_bytes(b"x")
    a = argparse.Namespace(ramp_versions=10, budget_tokens=0.0, budget_ratio=0.6, budget_lr=0.002)
    seen = {}
    for arm in cost_demo.ARMS[1:]:
        extra, keys = cost_demo.arm_setup(arm, 0.004, tmp_path, 40.0, a)
        TrainerConfig(**keys)  # validated as the trainer will
        seen[arm] = (extra, keys)
    assert seen["calibrated"][0] == ["--lambda", "0.004"] and "cost" not in seen["calibrated"][1]
    assert seen["success_only"][1]["cost"]["penalty"] == "success_only"
    assert seen["ramp"][0] == ["--lambda", "0"] and seen["ramp"][1]["cost"]["target"] == 0.004
    assert seen["budget"][1]["cost"]["budget_tokens"] == 0.6 * 40.0
    assert all(k["warmstart"]["reuse"] == str(tmp_path / "warmstart.pt") for _, k in seen.values())


def test_across_seeds_compares_every_arm_with_lambda0():
    per = [
        {"lambda": 0.01, "lambda0": arm(0.8, 40.0), "calibrated": arm(0.7, 20.0), "budget": arm(0.8, 24.0)},
        {"lambda": 0.01, "lambda0": arm(0.9, 40.0), "calibrated": arm(0.8, 20.0), "budget": arm(0.86, 20.0)},
    ]
    r = cost_demo.across_seeds(per)
    assert r["arms"] == ["lambda0", "calibrated", "budget"]
    assert abs(r["success_diff_budget"]["mean"] + 0.02) < 1e-9
    assert abs(r["tokens_ratio_budget"]["mean"] - 0.55) < 1e-9
    assert r["success_diff"] == r["success_diff_calibrated"]


def test_worst_gap_after_v25_and_the_tradeoff_plot(tmp_path):
    base = [{"version": v, "success": 0.8, "tokens": 30.0} for v in (0, 25, 50, 75)]
    arm = [
        {"version": 0, "success": 0.2, "tokens": 30.0},
        {"version": 25, "success": 0.5, "tokens": 20.0},
        {"version": 50, "success": 0.75, "tokens": 18.0},
        {"version": 75, "success": 0.6, "tokens": 16.0},
    ]
    assert abs(cost_demo.worst_gap(base, arm) - 0.2) < 1e-9  # v25's 0.3 gap is not after v25
    cost_demo.plot_tradeoff(
        {"lambda0": [(30.0, 0.8), (31.0, 0.78)], "budget": [(18.0, 0.79)]}, tmp_path / "t.png"
    )
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_arm_is_a_clear_error(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[trainer.tasks]\nenvs = ["arith-small"]\n')
    assert (
        cost_demo.main(["--config", str(cfg), "--arms", "lambda0,cheap", "--out", str(tmp_path / "o")]) == 2
    )
    assert "unknown arm(s) ['cheap']" in capsys.readouterr().err


TINY = """
[up]
workers = 1
scorers = 1
steps = 2
minutes = 3.0

[trainer.tasks]
envs = ["arith-small"]
backlog = 4
eval_every = 1
eval_prompts = 8
sampling = {temperature = 1.0, max_tokens = 24}

[trainer.batch]
groups = 2
group_size = 2

[trainer.warmstart]
steps = 5
batch = 8

[worker.engine]
slots = 4

[worker.run]
threads = 1
heartbeat_s = 1.0

[scorer.run]
heartbeat_s = 1.0
"""


@pytest.mark.chaos  # long: three `asyncrl up` runs and a calibration (minutes on 2 cores)
def test_cost_demo_end_to_end_on_a_tiny_run(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    out = tmp_path / "out"
    assert (
        cost_demo.main(
            [
                "--config",
                str(cfg),
                "--out",
                str(out),
                "--seeds",
                "0",
                "--prompts",
                "8",
                "--arms",
                "lambda0,success_only,budget",
                "--budget-tokens",
                "4",
            ]
        )
        == 0
    )
    result = json.loads((out / "compare.json").read_text())
    assert result["arms"] == ["lambda0", "success_only", "budget"]
    seed = result["per_seed"][0]
    path = seed["lambda_paths"]["budget"]
    assert path and all(p["lambda_next"] is not None for p in path)  # KV λ written each version
    assert path[-1]["lambda_next"] > 0  # answers over 4 tokens: λ rose
    assert (out / "tradeoff.png").read_bytes()[:4] == b"\x89PNG" and (out / "compare.png").exists()
    steps = [r for r in read_trainer_metrics(out / "seed0" / "budget") if "samples" in r]
    assert steps and all(
        len(r["group_lambda"]) == r["groups"] and r["lambda_mixed_groups"] == 0 for r in steps
    )


def test_without_a_warm_start_arms_start_from_the_config_and_need_a_given_lambda(tmp_path, capsys):
    import argparse

    a = argparse.Namespace(ramp_versions=10, budget_tokens=0.0, budget_ratio=0.6, budget_lr=0.002)
    assert cost_demo.arm_setup("success_only", 0.004, tmp_path, 40.0, a)[1] == {
        "cost": {"penalty": "success_only"}
    }
    base = _run(tmp_path, "base", [(0, 0.2, 20.0)])
    cfg = tmp_path / "c.toml"
    cfg.write_text('[trainer.tasks]\nenvs = ["arith-small"]\n')
    assert cost_demo.main(["--config", str(cfg), "--baseline", str(base), "--out", str(tmp_path / "o")]) == 2
    assert "--lambda-cal" in capsys.readouterr().err
    assert cost_demo.main(["--config", str(cfg), "--lambda-cal", "-1", "--out", str(tmp_path / "o")]) == 2


def test_the_objective_is_judged_at_the_arms_lambda_with_success_and_cost_apart():
    """success − λ·cost on held-out evals (the penalty's own objective), paired by seed; the success
    rate and the cost per success reported apart. Episodes are priced by the policy's tokens."""
    o = cost_demo.objective({"success_mean_evals": 0.5, "tokens_mean_evals": 200.0}, 0.001)
    assert o["value"] == pytest.approx(0.3) and o["cost_per_success"] == pytest.approx(400.0)
    assert (
        cost_demo.objective({"success_mean_evals": 0.0, "tokens_mean_evals": 9.0}, 0.1)["cost_per_success"]
        is None
    )

    per = [
        {"lambda": 0.001, "lambda0": arm(0.6, 300.0), "calibrated": arm(0.55, 150.0)},
        {"lambda": 0.002, "lambda0": arm(0.6, 300.0), "calibrated": arm(0.62, 280.0)},
    ]
    r = cost_demo.across_seeds(per)
    assert r["objective_lambda0"]["values"] == pytest.approx([0.3, 0.0])
    assert r["objective_diff_calibrated"]["values"] == pytest.approx([0.1, 0.06])


def test_episode_evals_are_priced_by_the_policy_tokens(tmp_path):
    d = tmp_path / "ep" / "metrics"
    d.mkdir(parents=True)
    rows = [{"version": 0, "eval_success": 0.5, "eval_tokens": 1500.0, "eval_model_tokens": 240.0, "ts": 0.0}]
    (d / "trainer.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert cost_demo.eval_curve(tmp_path / "ep")[0]["tokens"] == 240.0
