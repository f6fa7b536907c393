"""bench.learn's reader: held-out v0 and final from the run's summary, k3 per version from the
trainer's rows (dropped-batch rows carry no k3 and are not versions of their own), the spread over
runs, and a clear error for a run that did not finish or skipped its after-run evals."""

import json

import pytest

from bench.learn import main, spread, summarize


def make_run(path, *, final_eval="done", v0=0.4, final=0.85, k3=(0.0, 0.01, 0.02)):
    (path / "metrics").mkdir(parents=True)
    rows = [
        {
            "version": i + 1,
            "samples": 16,
            "k3_mean": k,
            "staleness_mean": 1.0,
            "success_mean": 0.5,
            "ts": 100.0 + i,
        }
        for i, k in enumerate(k3)
    ]
    rows.insert(2, {"version": 2, "samples": 16, "staleness_mean": 3.0, "success_mean": 0.5, "ts": 101.5})
    rows += [
        {"version": 0, "eval_success": v0, "eval_initial": True, "ts": 200.0},
        {"version": len(k3), "eval_success": final, "eval_final": True, "ts": 201.0},
    ]
    (path / "metrics" / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "versions": len(k3),
        "eval_success_initial": v0,
        "eval_success_final": final,
        "eval_version_final": len(k3),
        "final_eval": final_eval,
        "final_eval_s": 50.0,
        "stopped": "reached 3 versions",
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_summarize_reads_gain_k3_and_wall(tmp_path):
    r = summarize(make_run(tmp_path / "r"), wall_s=300.0)
    assert r["v0"] == 0.4 and r["final"] == 0.85 and r["gain_points"] == 45.0
    assert r["k3_per_version"] == [[1, 0.0], [2, 0.01], [3, 0.02]]  # the dropped batch's row is skipped
    assert r["k3_mean"] == pytest.approx(0.01) and r["k3_max"] == 0.02
    assert r["train_s"] == 250.0 and r["eval_s"] == 50.0 and r["versions"] == 3


def test_spread_over_runs(tmp_path):
    runs = [summarize(make_run(tmp_path / f"r{i}", final=f), 300.0) for i, f in enumerate((0.7, 0.8, 0.9))]
    s = spread(runs)
    assert s["gain_points"]["min"] == 30.0 and s["gain_points"]["max"] == 50.0
    assert s["gain_points"]["mean"] == pytest.approx(40.0)


def test_unfinished_or_uneval_run_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="did not finish"):
        summarize(tmp_path, wall_s=1.0)
    with pytest.raises(RuntimeError, match="after-run evals missing"):
        summarize(make_run(tmp_path / "r", final_eval="skipped: a signal stopped the run"), wall_s=1.0)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        main(["--runs", "0"])
