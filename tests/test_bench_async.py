"""bench.async's summary and comparison plot, on metrics written the way the trainer writes them."""

from __future__ import annotations

import importlib
import json

import pytest

bench = importlib.import_module("bench.async")


def write_run(d, per_step_s: float, staleness: dict) -> None:
    (d / "metrics").mkdir(parents=True)
    rows = [
        {
            "ts": 100 + i * per_step_s,
            "samples": 32,
            "live_samples": 32,
            "cost_mean": 30.0,
            "staleness_mean": sum(int(k) * v for k, v in staleness.items()) / 32,
            "staleness_hist": staleness,
            "dropped_stale": 0,
            "success_mean": 0.4 + 0.01 * i,
        }
        for i in range(12)
    ]
    (d / "metrics" / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "metrics" / "rollout_worker-w.jsonl").write_text(
        json.dumps({"ts": 101, "slot_occupancy": 0.9}) + "\n"
    )


def test_summary_and_plot(tmp_path):
    write_run(tmp_path / "async", 0.25, {"1": 10, "2": 22})
    write_run(tmp_path / "sync", 0.5, {"0": 32})
    a, s = bench.summarize(tmp_path / "async"), bench.summarize(tmp_path / "sync")
    assert a["samples_per_s"] == pytest.approx(32 * 11 / (11 * 0.25))
    assert a["samples_per_s"] / s["samples_per_s"] == pytest.approx(2.0)
    assert a["worker_idle_frac"] == pytest.approx(0.1) and a["mean_staleness"] == pytest.approx(54 / 32)
    result = {
        "async_samples_per_s": a["samples_per_s"],
        "sync_samples_per_s": s["samples_per_s"],
        "speedup": 2.0,
        "mean_staleness_async": a["mean_staleness"],
    }
    png = bench.plot_compare(tmp_path, result)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_too_few_steps_is_a_clear_error(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "trainer.jsonl").write_text(json.dumps({"ts": 1, "samples": 32}) + "\n")
    with pytest.raises(RuntimeError, match="only 1 steps"):
        bench.summarize(tmp_path, "async")
