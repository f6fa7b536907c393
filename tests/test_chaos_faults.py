"""Long fault-injection scenarios (make test-chaos): real trainer / scorer / worker processes,
real nats-server, faults by signal. Each scenario is bounded and checks its own guarantees
(bench/chaoskit); here every one must report nothing lost, nothing trained twice,
recovery within its target."""

from __future__ import annotations

import pytest

from bench.chaoskit.params import ACK_WAIT_S, BATCH_GROUPS, GROUP, LEASE_TTL_S
from bench.chaoskit.scenarios_bus import cluster_node_loss, restart_nats
from bench.chaoskit.scenarios_fleet import random_kill_storm, up_supervisor
from bench.chaoskit.scenarios_trainer import (
    background_checkpoint_kill,
    deferred_checkpoint_kill,
    leader_failover,
    slow_step_kill,
    sync_poison_task,
)
from bench.chaoskit.scenarios_workers import (
    backlog,
    kill_scorer,
    kill_workers,
    pause_worker,
    worker_feed_crash,
)

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


def check(r: dict) -> None:
    # the message as a string: pytest would shorten a dict to its first keys
    assert r["lost"] == 0, f"{r}"
    assert r["duplicates_trained"] == 0, f"{r}"
    assert r["passed"], f"{r}"


async def test_worker_sigkill_at_random_instants(tmp_path):
    r = await kill_workers(tmp_path, tasks=200, kills=3)
    check(r)
    assert r["tasks"] == 200 and r["kills"] >= 3 and r["redelivered"] > 0
    assert r["recovery_s"] <= ACK_WAIT_S + 10


async def test_scorer_sigkill_mid_batch(tmp_path):
    r = await kill_scorer(tmp_path, tasks=100)
    check(r)
    assert r["redelivered"] > 0 and r["recovery_s"] <= ACK_WAIT_S + 10


async def test_trainer_leader_sigkill_then_sigstop(tmp_path):
    killed, paused = await leader_failover(tmp_path, tasks=200)
    for r in (killed, paused):
        check(r)
        assert r["recovery_s"] <= LEASE_TTL_S + 5
    assert killed["gaps"] == 0 and killed["forks"] == 0
    assert paused["old_leader_stepped_down"] and paused["epochs"] >= 3
    assert paused["refused_by_workers"] >= paused["late_old_epoch_deltas"]
    # the woken leader is made to publish: every attempt refused by the server, none in the stream
    assert paused["deposed_publish_attempts"] >= 1
    assert paused["deposed_publish_refused"] == paused["deposed_publish_attempts"]
    assert paused["late_old_epoch_deltas"] == 0


async def test_nats_server_restart_same_store(tmp_path):
    check(await restart_nats(tmp_path, tasks=100))


async def test_cluster_node_sigkill_r3(tmp_path):
    check(await cluster_node_loss(tmp_path, tasks=100))


async def test_worker_sigstop_beyond_ack_wait(tmp_path):
    r = await pause_worker(tmp_path, tasks=100)
    check(r)
    assert r["paused_s"] > ACK_WAIT_S and r["redelivered"] > 0 and r["rollouts_stored_twice"] == 0


async def test_backlog_10k_worker_memory_bounded(tmp_path):
    r = await backlog(tmp_path, tasks=10_000)
    assert r["passed"] and r["lost"] == 0 and r["rollouts_stored_twice"] == 0, r
    assert r["duplicates_trained"] is None and r["trained"] is None  # no trainer: no claim
    assert r["queued"] == 10_000 and r["held_max"] <= r["held_cap"] and r["rss_growth_mb"] < 50


# (short versions in the default suite: tests/test_trainer_slow_step.py,
# tests/test_trainer_sync_dlq.py)
async def test_slow_step_leader_killed_before_checkpoint(tmp_path):
    r = await slow_step_kill(tmp_path, tasks=40)
    check(r)
    assert (
        r["version_at_kill"] == 0
        and r["leader_logged_steps"] == 0
        and r["held_at_kill"] >= BATCH_GROUPS * GROUP
    )
    assert r["first_version_after_death_s"] is not None


# (short version in the default suite: tests/test_trainer_bus.py
# test_checkpoint_every_k_acks_only_after_the_checkpoint_and_a_crash_retrains_the_rest)
async def test_leader_killed_between_a_step_and_its_deferred_checkpoint(tmp_path):
    r = await deferred_checkpoint_kill(tmp_path, tasks=40, every=3)
    check(r)
    assert r["checkpoint_at_kill"] < r["version_at_kill"] and 1 <= len(r["rolled_back_versions"]) <= 2, r
    assert r["rolled_back_ids"] >= BATCH_GROUPS * GROUP and r["trained"] == 40 * GROUP - r["dropped"], r


# (short version in the default suite: tests/test_trainer_background_checkpoint.py)
async def test_leader_killed_with_a_background_checkpoint_in_flight(tmp_path):
    r = await background_checkpoint_kill(tmp_path, tasks=40)
    check(r)
    assert r["checkpoint_at_kill"] < r["version_at_kill"] and r["rolled_back_versions"], r
    assert r["rolled_back_ids"] >= BATCH_GROUPS * GROUP and r["trained"] == 40 * GROUP - r["dropped"], r


async def test_sync_run_goes_on_past_a_poison_task(tmp_path):
    r = await sync_poison_task(tmp_path, tasks=4)
    check(r)
    assert r["versions"] >= 4 and r["sync_replaced"] >= 1 and r["poison_parked"] == GROUP


async def test_random_kill_storm(tmp_path):
    r = await random_kill_storm(tmp_path, duration_s=90, every_s=(5.0, 10.0))
    check(r)
    assert r["kills"] >= 5 and r["gaps"] == 0 and r["forks"] == 0


# supervision (short versions in the default suite: tests/test_worker_supervise.py,
# tests/test_up_supervise.py)
async def test_worker_feed_crash_recovers_to_the_latest_version(tmp_path):
    r = await worker_feed_crash(tmp_path, tasks=60)
    check(r)
    assert r["feed_restarts"] >= 1 and r["worker_version"] == r["latest_version"] and r["recovery_s"] >= 0


async def test_up_supervisor_replaces_killed_children(tmp_path):
    r = await up_supervisor(tmp_path, kills=5)
    check(r)
    assert r["restarts"] == r["kills"] and sum(r["kills"].values()) == 5 and r["exit_code"] == 0
