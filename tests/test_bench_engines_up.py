"""bench.engines_up's metrics reader: the last worker row per run, vLLM's start-up from its log,
the vllm/torch ratios, and a clear error for a run dir without worker metrics."""

import json

import pytest

from bench.engines_up import ratios, summarize


def write_run(run_dir, rows, log_lines=()):
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "logs").mkdir()
    with open(run_dir / "metrics" / "rollout_worker-0.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (run_dir / "logs" / "worker-0.log").write_text("".join(json.dumps(x) + "\n" for x in log_lines))


def row(ts, version, tps, step, p50, p99, updates):
    return {
        "t": ts,
        "ts": 1000.0 + ts,
        "version": version,
        "tokens_per_busy_s": tps,
        "decode_step_ms_p50": step,
        "update_stall_ms_p50": p50,
        "update_stall_ms_p99": p99,
        "update_stall_total_ms_p99": 999.0,
        "updates": updates,
    }


def test_summary_and_ratios(tmp_path):
    # rows out of order on disk: the reader takes the newest by ts
    write_run(
        tmp_path / "torch", [row(20, 3, 50.0, 80.0, 100.0, 300.0, 3), row(10, 1, 40.0, 90.0, 110.0, 200.0, 1)]
    )
    write_run(
        tmp_path / "vllm",
        [row(5, 0, 0.0, None, None, None, 0), row(30, 4, 150.0, 20.0, 25.0, 60.0, 4)],
        [{"event": "weights loaded"}, {"event": "vllm engine started", "start_s": 21.5}],
    )
    t, v = summarize(tmp_path / "torch"), summarize(tmp_path / "vllm")
    assert (t["tokens_per_busy_s"], t["decode_step_ms_p50"], t["update_stall_ms_p99"]) == (50.0, 80.0, 300.0)
    assert (t["versions_applied"], t["last_version"], t["start_s"]) == (3, 3, None)
    assert (v["update_stall_ms_p50"], v["versions_applied"], v["start_s"]) == (25.0, 4, 21.5)
    r = ratios(t, v)
    assert r["tokens_per_busy_s_vllm_over_torch"] == pytest.approx(3.0)
    assert r["decode_step_ms_p50_vllm_over_torch"] == pytest.approx(0.25)
    assert r["update_stall_ms_p50_vllm_over_torch"] == pytest.approx(0.25)


def test_missing_or_empty_run_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="rollout_worker-.*jsonl under"):
        summarize(tmp_path / "nope")
    write_run(tmp_path / "empty", [])
    with pytest.raises(ValueError, match="empty"):
        summarize(tmp_path / "empty")
