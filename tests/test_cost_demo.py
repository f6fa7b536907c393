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
