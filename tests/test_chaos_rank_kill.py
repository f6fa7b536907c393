"""Spare-node swap end to end (make test-chaos): three torchrun elastic agents (nnodes 2:2, one
spare) on a real nats-server with a real worker and scorer; the leader rank's node and then the other
rank's node SIGKILLed mid-step; the group re-forms with the spare from the last sharded checkpoint.
Minutes on 2 cores, hence chaos-marked; the pieces it relies on have short tests in
tests/test_trainer_fsdp.py and tests/test_trainer_elastic.py."""

from __future__ import annotations

import pytest

from bench.chaoskit.scenarios_rank_kill import trainer_rank_kill

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


async def test_rank_kill_reforms_with_the_spare_without_gap_fork_or_retraining(tmp_path):
    r = await trainer_rank_kill(tmp_path, tasks=40)
    assert r["lost"] == 0 and r["duplicates_trained"] == 0, r
    assert r["gaps"] == 0 and r["forks"] == 0 and r["epochs"] >= 3, r  # one epoch per group formation
    assert [k["rank"] for k in r["kills"]] == [0, 1] and r["spare_joined"], r
    for k in r["kills"]:  # resumed at the last checkpointed version, not before
        assert k["first_version"] >= k["version_at_kill"] - 1 and k["first_version"] >= 1, r
    assert r["passed"], r
