"""bench.agentic: the worker's idle fraction over the trainer's window, the episode distributions
read from the records a real worker's episode runner writes, and (make test-bench: ~8 minutes) the whole bench
at tiny size, so the ratio and every distribution it prints stay computed from a run."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.events import SamplingParams, Task
from envs.episode import EpisodeLimits
from envs.sandbox import BashLimits
from rollout_worker.episodes import EpisodeRunner, episode_spec
from rollout_worker.torch_engine import TorchEngine
from tests.helpers.agentic import CFG, TOK, bug_task, no_special_state

bench = importlib.import_module("bench.agentic")
ROOT = Path(__file__).resolve().parents[1]


def test_busy_fraction_caps_in_flight_at_the_slots_and_clips_to_the_window():
    # 2 slots, window [10, 20]: [0, 15] counts 5 s, [12, 14] 2 s, [13, 30] 7 s; over 13..14 three
    # episodes are in flight (one queued for a slot): 2 slot-seconds there, not 3
    spans = [(0.0, 15.0), (12.0, 14.0), (13.0, 30.0)]
    assert bench.busy_fraction(spans, 2, 10.0, 20.0) == pytest.approx((5 + 2 + 7 - 1) / 20)
    assert bench.busy_fraction([], 2, 10.0, 20.0) == 0.0
    assert bench.busy_fraction([(0.0, 100.0)] * 5, 2, 10.0, 20.0) == pytest.approx(1.0)
    # back to back in one slot: the slot is busy all the time, never counted twice
    assert bench.busy_fraction([(10.0, 15.0), (15.0, 20.0)], 1, 10.0, 20.0) == pytest.approx(1.0)
    assert bench.busy_fraction([(21.0, 25.0), (1.0, 9.0)], 1, 10.0, 20.0) == 0.0


async def real_episode_records(n: int) -> list[dict]:
    """n episodes played by the worker's EpisodeRunner on the torch engine (a random model: each
    ends by `format` after its format errors), as the worker's metrics carry them."""
    eng = TorchEngine(CFG, slots=2, max_len=2048, seed=3, eos_id=TOK.eos_id)
    await eng.load_keyframe(no_special_state(3), 1, 0)
    runner = EpisodeRunner(eng, TOK, worker_id="w")
    limits = EpisodeLimits(max_turn_tokens=16, max_format_errors=2, command=BashLimits(wall_s=2.0))
    task = Task(
        task_id="ep",
        env="swe-gen",
        prompt="Fix calc.py.",
        spec=episode_spec(bug_task(), limits),
        sampling={"max_tokens": 16, "n": 1},
    )
    try:
        for i in range(n):
            await runner.run(task, SamplingParams(max_tokens=16, n=1), i)
    finally:
        await eng.close()
    return runner.drain()


def write_run(d: Path, episodes: list[dict], t0: float, t1: float, slots: int) -> None:
    """A run dir as `asyncrl up` leaves it: the trainer's steps, the worker's metrics lines with
    the episodes that ended since the last beat, the worker's config."""
    (d / "metrics").mkdir(parents=True)
    (d / "config").mkdir()
    steps = [
        {"ts": t0 + (t1 - t0) * i / 3, "samples": 2, "live_samples": 2, "total_s": 0.5 + i} for i in range(4)
    ]
    (d / "metrics" / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    beats = [{"ts": e["ended_at"] + 0.1, "slot_occupancy": 0.5, "episodes_ended": [e]} for e in episodes]
    (d / "metrics" / "rollout_worker-worker-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in beats))
    (d / "config" / "worker-0.toml").write_text(f'worker_id = "worker-0"\n[engine]\nslots = {slots}\n')


async def test_episode_stats_read_the_records_a_real_worker_writes(tmp_path):
    t_start = time.time()
    eps = await real_episode_records(3)
    # each record says when it ended on the wall clock the trainer stamps its steps with
    assert t_start <= eps[0]["ended_at"] <= eps[1]["ended_at"] <= eps[2]["ended_at"] <= time.time()
    assert len(eps) == 3 and all(e["turns"] == 2 and e["termination"] == "format" for e in eps)
    # a timeline from those episodes: the middle one ended inside the window, the others outside
    base = 1_000_000.0
    eps[0]["ended_at"], eps[1]["ended_at"], eps[2]["ended_at"] = base - 5, base + 10, base + 100
    eps[1]["tool_wall_s"], eps[1]["wall_s"] = 1.5, 6.0  # as if its commands had run 1.5 s of 6
    eps[1]["suite_wait_s"], eps[1]["suite_runs"] = 3.0, 2  # and a modelled suite 1.5 s, twice
    write_run(tmp_path, eps, base, base + 20, slots=2)
    st = bench.episode_stats(tmp_path)
    assert st["episodes"] == 1
    assert st["turns"]["mean"] == 2 and st["turns_hist"] == {"2": 1}
    assert st["terminations"] == {"format": 1}
    assert (
        st["episode_tokens"]["max"] == eps[1]["tokens"]
        and st["episode_model_tokens"]["max"] == eps[1]["model_tokens"]
    )
    assert st["tool_wall_share"] == pytest.approx(0.25)
    assert st["suite_wait_share"] == pytest.approx(0.5) and st["suite_runs"]["mean"] == 2
    # slot-time held over the 20 s window by episodes: the middle one's 6 s, the first one's
    # overlap (if it reached into the window), the last one's overlap
    spans = [(e["ended_at"] - e["wall_s"], e["ended_at"]) for e in eps]
    held = sum(max(0.0, min(b, base + 20) - max(a, base)) for a, b in spans)
    assert st["worker_idle_frac"] == pytest.approx(1 - held / 40)
    assert 0.0 <= st["worker_idle_frac"] <= 1.0


def test_records_without_their_end_time_are_a_clear_error(tmp_path):
    old = {
        "turns": 2,
        "tool_calls": 0,
        "tokens": 10,
        "model_tokens": 5,
        "wall_s": 1.0,
        "tool_wall_s": 0.0,
        "termination": "format",
        "reward": 0.0,
        "resolved": False,
    }
    write_run(tmp_path, [{**old, "ended_at": 5.0}], 0.0, 10.0, slots=1)
    rows = [
        json.loads(x)
        for x in (tmp_path / "metrics" / "rollout_worker-worker-0.jsonl").read_text().splitlines()
    ]
    rows[0]["episodes_ended"] = [old]
    (tmp_path / "metrics" / "rollout_worker-worker-0.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(RuntimeError, match="without ended_at"):
        bench.episode_stats(tmp_path)


def test_workload_is_read_from_the_run_configs_and_named_in_the_caveats(tmp_path):
    """The JSON says which workload ran (from the configs `up` wrote, not the flags) and, for the
    long-tail one, that its test-suite time is modelled."""
    side = {
        "steps": 20,
        "terminations": {"submitted": 8},
        "episodes": 8,
        "trainer_busy_frac": 0.3,
        "tool_calls": {"mean": 2.0},
    }
    default, longtail = tmp_path / "default", tmp_path / "longtail"
    write_run(default, [], 0.0, 10.0, slots=8)
    w = bench.workload(default)
    assert w["name"] == "default" and w["slots"] == w["max_inflight"] == 8 and "test_latency" not in w
    assert w["group_timeout_s"] == 120.0 and w["episode_wall_s"] is None
    assert any("default workload" in c for c in bench.caveats(side, side, w))
    write_run(longtail, [], 0.0, 10.0, slots=8)
    with open(longtail / "config" / "worker-0.toml", "a") as f:
        f.write(
            "[admission]\nmax_inflight = 16\n[episodes]\nepisode_wall_s = 900.0\n"
            "[episodes.sandbox_latency]\nmedian_s = 3.0\np99_s = 60.0\n"
        )
    (longtail / "config" / "trainer.toml").write_text("[batch]\ngroup_timeout_s = 1200.0\n")
    w = bench.workload(longtail)
    assert w["name"] == "long-tail" and w["max_inflight"] == 16 and w["episode_wall_s"] == 900.0
    assert w["group_timeout_s"] == 1200.0
    lat = w["test_latency"]
    assert (lat["median_s"], lat["p99_s"]) == (3.0, 60.0) and lat["mean_s"] > lat["median_s"]
    assert lat["sigma"] == pytest.approx(1.2878, abs=1e-3)  # ln(60 / 3) / z(0.99)
    assert any("modelled" in c and "median 3.0 s" in c for c in bench.caveats(side, side, w))
    assert not any("rarely runs the tests" in c for c in bench.caveats(side, side, w))
    scoring_only = {**side, "suite_runs": {"mean": 1.0}}  # one suite run an episode: the scoring run
    assert any("rarely runs the tests" in c for c in bench.caveats(scoring_only, side, w))


def test_test_latency_flag_is_checked():
    assert bench.parse_latency("3,60") == (3.0, 60.0) and bench.parse_latency("0") == (0.0, 0.0)
    for bad in ("3", "3,1", "-1,5", "3,60,9"):
        with pytest.raises(Exception):  # noqa: B017  (any error will do: which one depends on the input)
            bench.parse_latency(bad)
    with pytest.raises(SystemExit):  # argparse turns it into a usage error, before any run
        bench.main(["--test-latency", "3,1", "--out", "/nonexistent/never-made"])


def test_decoder_idle_share_comes_from_the_engines_decode_seconds(tmp_path):
    write_run(tmp_path, [], 100.0, 130.0, slots=2)
    # decode steps ran 6 of the 20 s between the first and last beat in the window
    beats = [
        {"ts": 90.0, "busy_s": 0.0},
        {"ts": 105.0, "busy_s": 1.0},
        {"ts": 115.0, "busy_s": 4.0},
        {"ts": 125.0, "busy_s": 7.0},
        {"ts": 140.0, "busy_s": 20.0},
    ]
    (tmp_path / "metrics" / "rollout_worker-worker-0.jsonl").write_text(
        "".join(json.dumps(b) + "\n" for b in beats)
    )
    assert bench.episode_stats(tmp_path)["decoder_idle_frac"] == pytest.approx(1 - 6 / 20)


@pytest.mark.bench
@pytest.mark.timeout(1500)
def test_tiny_bench_prints_one_sane_json_object(tmp_path):
    """The whole bench at tiny size (minutes): one warm-start step, 3 versions of 2 episodes each
    way on a small task set. Structure and sanity only; its speeds mean nothing at this size."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "ASYNCRL_SWE_TASKS": str(tmp_path / "tasks"),
        "ASYNCRL_SWE_GEN": "10",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.agentic",
            "--json",
            "--steps",
            "3",
            "--minutes",
            "3",
            "--warmstart-steps",
            "1",
            "--eval-prompts",
            "0",
            "--slots",
            "2",
            "--group-size",
            "2",
            "--batch-groups",
            "1",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["speedup"] > 0 and res["async_samples_per_s"] > 0 and res["sync_samples_per_s"] > 0
    assert res["speedup"] == pytest.approx(res["async_samples_per_s"] / res["sync_samples_per_s"])
    for side in ("async", "sync"):
        assert res["steps"][side] >= 3 and res["episodes"][side] >= 1
        assert 0.0 <= res["worker_idle_frac"][side] <= 1.0
        assert 0.0 <= res["tool_wall_share"][side] <= 1.0
        assert sum(res["turns_hist"][side].values()) == res["episodes"][side] == res["turns"][side]["n"]
        assert sum(res["terminations"][side].values()) == res["episodes"][side]
        assert res["episode_tokens"][side]["max"] >= res["episode_tokens"][side]["p50"] > 0
        assert res["trainer_step_s"][side]["mean"] > 0 and 0.0 < res["trainer_busy_frac"][side] <= 1.2
    assert res["final_eval_success"] is None
    assert res["workload"]["name"] == "default" and res["workload"]["slots"] == 2
