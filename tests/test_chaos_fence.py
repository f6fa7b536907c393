"""Signed epochs and server fencing end to end (make test-chaos): real trainer / scorer / worker
processes on a real nats-server. The short versions in the default suite are tests/test_trainer_fence.py and
tests/test_weights_signed_fields.py."""

from __future__ import annotations

import pytest

from bench.chaoskit.params import LEASE_TTL_S
from bench.chaoskit.scenarios_bus import forged_weights
from bench.chaoskit.scenarios_trainer import deposed_leader_publish

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


def check(r: dict) -> None:
    assert r["lost"] == 0 and r["duplicates_trained"] == 0, r
    assert r["passed"], r


async def test_forged_weights_are_refused_and_workers_follow_the_real_leader(tmp_path):
    r = await forged_weights(tmp_path, tasks=60)
    check(r)
    assert r["worker_epochs"] == [r["real_epoch"]]
    for reasons in r["refusals"].values():
        assert reasons.get("fields", 0) >= 1 and reasons.get("corrupt", 0) >= 1, r


async def test_deposed_leader_publish_is_refused_by_the_server(tmp_path):
    r = await deposed_leader_publish(tmp_path, tasks=80)
    check(r)
    assert (
        r["deposed_publish_attempts"] >= 1 and r["deposed_publish_refused"] == r["deposed_publish_attempts"]
    )
    assert r["old_epoch_after_takeover"] == [] and r["gaps"] == 0 and r["forks"] == 0
    assert r["recovery_s"] <= LEASE_TTL_S + 5


async def test_deposed_leader_manifest_is_refused_by_the_server(tmp_path):
    """The same with `publish = "sharded"`: the frozen leader's manifest, and its probe, refused."""
    r = await deposed_leader_publish(tmp_path, tasks=60, publish="sharded")
    check(r)
    assert r["manifests"] >= r["versions"] - 1 > 0, r  # versions went out as manifests
    assert (
        r["deposed_publish_attempts"] >= 1 and r["deposed_publish_refused"] == r["deposed_publish_attempts"]
    )
    assert r["old_epoch_after_takeover"] == [] and r["gaps"] == 0 and r["forks"] == 0
