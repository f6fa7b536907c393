"""asyncrl cost-demo: the comparison it draws from two runs' held-out evals."""
import json

from asyncrl import cost_demo


def _run(tmp_path, name, evals):
    d = tmp_path / name / "metrics"
    d.mkdir(parents=True)
    rows = [{"version": v, "eval_success": s, "eval_tokens": t, "ts": float(v)} for v, s, t in evals]
    rows.insert(1, {"version": 1, "samples": 16, "ts": 1.0})          # step rows are not evals
    (d / "trainer.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return tmp_path / name


def test_summary_uses_the_first_eval_and_the_mean_of_the_last_three(tmp_path):
    run = _run(tmp_path, "a", [(0, 0.2, 20.0), (25, 0.5, 30.0), (50, 0.6, 32.0), (75, 0.7, 34.0), (100, 0.8, 36.0)])
    curve = cost_demo.eval_curve(run)
    assert [c["version"] for c in curve] == [0, 25, 50, 75, 100]
    s = cost_demo.summarize(curve)
    assert s["success_initial"] == 0.2 and s["tokens_initial"] == 20.0
    assert abs(s["success_final"] - 0.7) < 1e-9 and abs(s["tokens_final"] - 34.0) < 1e-9
    assert s["final_versions"] == [50, 75, 100]


def test_plot_writes_a_png(tmp_path):
    a = cost_demo.eval_curve(_run(tmp_path, "a", [(0, 0.2, 20.0), (25, 0.5, 30.0)]))
    b = cost_demo.eval_curve(_run(tmp_path, "b", [(0, 0.2, 20.0), (25, 0.5, 18.0)]))
    cost_demo.plot({"λ = 0": a, "λ = 0.004": b}, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_warm_start_is_a_clear_error(tmp_path, capsys):
    base = _run(tmp_path, "base", [(0, 0.2, 20.0)])
    cfg = tmp_path / "c.toml"
    cfg.write_text('[trainer]\nenvs = ["arith-small"]\n')
    assert cost_demo.main(["--config", str(cfg), "--baseline", str(base), "--out", str(tmp_path / "o")]) == 2
    assert "warmstart.pt missing" in capsys.readouterr().err


def test_mean_over_evals_excludes_version_0():
    s = cost_demo.summarize([{"version": 0, "success": 0.2, "tokens": 20.0},
                             {"version": 25, "success": 0.6, "tokens": 30.0},
                             {"version": 50, "success": 0.8, "tokens": 40.0}])
    assert abs(s["success_mean_evals"] - 0.7) < 1e-9 and abs(s["tokens_mean_evals"] - 35.0) < 1e-9


def test_config_for_seed_sets_the_trainer_seed_only():
    import tomllib
    text = '[up]\nsteps = 5\n[trainer]\nlr = 1e-3\nseed = 7\n[worker]\nseed = 3\n'
    conf = tomllib.loads(cost_demo.config_for_seed(text, 2))
    assert conf["trainer"]["seed"] == 2 and conf["worker"]["seed"] == 3 and conf["up"]["steps"] == 5
    conf = tomllib.loads(cost_demo.config_for_seed('[trainer]\nlr = 1e-3\n[worker]\nslots = 2\n', 4))
    assert conf["trainer"] == {"lr": 1e-3, "seed": 4}
    assert tomllib.loads(cost_demo.config_for_seed('[up]\nsteps = 1\n', 1))["trainer"]["seed"] == 1


def test_across_seeds_pairs_the_arms():
    def arm(s, t):
        return {"success_mean_evals": s, "tokens_mean_evals": t}
    per = [{"lambda": 0.01, "lambda0": arm(0.8, 40.0), "calibrated": arm(0.78, 20.0)},
           {"lambda": 0.02, "lambda0": arm(0.9, 40.0), "calibrated": arm(0.86, 24.0)}]
    r = cost_demo.across_seeds(per)
    assert abs(r["success_diff"]["mean"] + 0.03) < 1e-9 and abs(r["tokens_ratio"]["mean"] - 0.55) < 1e-9
    assert r["success_lambda0"]["n"] == 2 and r["success_lambda0"]["std"] > 0


def test_seeds_and_baseline_do_not_mix(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[trainer]\nenvs = ["arith-small"]\n')
    assert cost_demo.main(["--config", str(cfg), "--baseline", "x", "--seeds", "0,1", "--out", str(tmp_path / "o")]) == 2
    assert "--baseline" in capsys.readouterr().err
