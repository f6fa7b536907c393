"""envs/sandbox_latency.py: a remote sandbox's test-suite time, modelled per task (bench.agentic's
long-tail workload): the draw's distribution, which commands wait, that the wait is wall time in
the episode's tool seconds and scoring but no local CPU."""

from __future__ import annotations

import time

import numpy as np
import pytest

from envs.episode import Episode, EpisodeLimits
from envs.sandbox import BashLimits
from envs.sandbox_latency import LatencyBackend, SandboxLatency, runs_tests
from envs.workspace import LocalBackend
from kernel import load_config
from rollout_worker.config import WorkerConfig
from tests.helpers.agentic import bug_task


def test_per_task_draws_are_deterministic_lognormal_with_the_given_median_and_p99():
    lat = SandboxLatency(median_s=3.0, p99_s=60.0, cap_s=1000.0)
    xs = np.array([lat.seconds(f"task-{i}") for i in range(20000)])
    assert (
        lat.seconds("task-7")
        == xs[7]
        == SandboxLatency(median_s=3.0, p99_s=60.0, cap_s=1000.0).seconds("task-7")
    )
    assert np.median(xs) == pytest.approx(3.0, rel=0.05)
    assert np.percentile(xs, 99) == pytest.approx(60.0, rel=0.15)
    assert len(set(xs.tolist())) > 19000  # a draw per task, not a constant
    assert SandboxLatency(median_s=3.0, p99_s=60.0, seed=1).seconds("task-7") != xs[7]
    capped = SandboxLatency(median_s=3.0, p99_s=60.0, cap_s=20.0)
    assert max(capped.seconds(f"task-{i}") for i in range(2000)) == 20.0
    assert SandboxLatency().seconds("task-7") == 0.0 and not SandboxLatency().enabled
    assert SandboxLatency(median_s=2.0, p99_s=2.0).seconds("x") == pytest.approx(2.0)  # sigma 0: fixed


@pytest.mark.parametrize(
    "bad", [dict(median_s=-1.0), dict(median_s=3.0, p99_s=1.0), dict(median_s=3.0, p99_s=9.0, cap_s=0.0)]
)
def test_bad_latency_settings_are_a_clear_error(bad, tmp_path):
    with pytest.raises(ValueError, match="sandbox latency"):
        SandboxLatency(**bad)
    p = tmp_path / "w.toml"
    p.write_text("[episodes.sandbox_latency]\n" + "".join(f"{k} = {v}\n" for k, v in bad.items()))
    with pytest.raises(Exception, match="sandbox latency"):
        load_config(WorkerConfig, p, env_prefix="")


def test_worker_config_reads_the_latency_table(tmp_path):
    p = tmp_path / "w.toml"
    p.write_text(
        "[engine]\nslots = 2\n[admission]\nmax_inflight = 5\n[episodes]\nepisode_wall_s = 600\n"
        "[episodes.sandbox_latency]\nmedian_s = 3\np99_s = 60\n"
    )
    cfg = load_config(WorkerConfig, p, env_prefix="")
    assert cfg.episodes.sandbox_latency == SandboxLatency(median_s=3.0, p99_s=60.0)
    assert cfg.admission.max_inflight == 5
    assert WorkerConfig(engine={"slots": 4}).admission.max_inflight == 4
    with pytest.raises(ValueError, match="max_inflight"):
        WorkerConfig(engine={"slots": 4}, admission={"max_inflight": 2})


def test_which_commands_run_the_suite():
    for c in ("run_tests", "run_tests -k add", "cd x && run_tests | cat", "(run_tests)", "true; run_tests"):
        assert runs_tests(c), c
    for c in ("view calc.py", "cat run_tests.log", "echo my_run_tests", "submit"):
        assert not runs_tests(c), c


def test_an_episode_waits_the_suite_time_on_run_tests_and_scoring_without_local_cpu():
    wait = 0.6
    backend = LatencyBackend(LocalBackend(), SandboxLatency(median_s=wait, p99_s=wait))
    ep = Episode(bug_task(), EpisodeLimits(command=BashLimits(wall_s=10.0)), backend=backend)
    try:
        ep.reset()
        t, cpu = time.monotonic(), time.thread_time()
        r = ep.step("```bash\nview calc.py\n```")
        assert r.info["command_wall_s"] < wait  # not a test run: no wait
        r = ep.step("```bash\nrun_tests\n```")
        assert r.info["command_wall_s"] >= wait and "1 failed" in r.observation  # the real suite's output
        assert ep.tool_wall_s >= wait
        t_score = time.monotonic()
        res = ep.score()
        assert time.monotonic() - t_score >= wait and res.reward == 0.0  # scoring runs the suite too
        assert time.monotonic() - t >= 2 * wait
        assert time.thread_time() - cpu < wait / 2  # waited in sleep, not burning this machine's CPU
        assert ep.workspace.waited_s == pytest.approx(2 * wait) and ep.workspace.suite_runs == 2
    finally:
        ep.close()
