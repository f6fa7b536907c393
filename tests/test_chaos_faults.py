"""Long fault-injection scenarios (make test-chaos): real trainer / scorer / worker processes,
real nats-server, faults by signal. Each scenario is bounded and checks its own guarantees
(bench/chaos_harness.py); here every one must report nothing lost, nothing trained twice,
recovery within its target."""
from __future__ import annotations

import pytest

from bench import chaos_harness as h

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


def check(r: dict) -> None:
    assert r["lost"] == 0, r
    assert r["duplicates_trained"] == 0, r
    assert r["passed"], r


async def test_worker_sigkill_at_random_instants(tmp_path):
    r = await h.kill_workers(tmp_path, tasks=200, kills=3)
    check(r)
    assert r["tasks"] == 200 and r["kills"] >= 3 and r["redelivered"] > 0
    assert r["recovery_s"] <= h.ACK_WAIT_S + 10


async def test_scorer_sigkill_mid_batch(tmp_path):
    r = await h.kill_scorer(tmp_path, tasks=100)
    check(r)
    assert r["redelivered"] > 0 and r["recovery_s"] <= h.ACK_WAIT_S + 10


async def test_trainer_leader_sigkill_then_sigstop(tmp_path):
    killed, paused = await h.leader_failover(tmp_path, tasks=200)
    for r in (killed, paused):
        check(r)
        assert r["recovery_s"] <= h.LEASE_TTL_S + 5
    assert killed["gaps"] == 0 and killed["forks"] == 0
    assert paused["old_leader_stepped_down"] and paused["epochs"] >= 3
    assert paused["refused_by_workers"] >= paused["late_old_epoch_deltas"]
    # the woken leader is made to publish: every attempt refused by the server, none in the stream
    assert paused["deposed_publish_attempts"] >= 1
    assert paused["deposed_publish_refused"] == paused["deposed_publish_attempts"]
    assert paused["late_old_epoch_deltas"] == 0


async def test_nats_server_restart_same_store(tmp_path):
    check(await h.restart_nats(tmp_path, tasks=100))


async def test_cluster_node_sigkill_r3(tmp_path):
    check(await h.cluster_node_loss(tmp_path, tasks=100))


async def test_worker_sigstop_beyond_ack_wait(tmp_path):
    r = await h.pause_worker(tmp_path, tasks=100)
    check(r)
    assert r["paused_s"] > h.ACK_WAIT_S and r["redelivered"] > 0 and r["rollouts_stored_twice"] == 0


async def test_backlog_10k_worker_memory_bounded(tmp_path):
    r = await h.backlog(tmp_path, tasks=10_000)
    check(r)
    assert r["queued"] == 10_000 and r["held_max"] <= r["held_cap"] and r["rss_growth_mb"] < 50
