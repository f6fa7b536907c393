"""The chaos harness's own detectors, on hand-made evidence: a harness that cannot see a lost
task, a rollout trained twice, a version gap or a fork would pass every scenario. Plus one short
real-process scenario (bad events and a poison task -> DLQ while training goes on)."""

from __future__ import annotations

import json

import pytest

from bench.chaoskit.books import row
from bench.chaoskit.fleet import Fleet
from bench.chaoskit.observe import version_line
from bench.chaoskit.params import GROUP
from bench.chaoskit.scenarios_bus import bad_input
from bench.chaoskit.scenarios_trainer import slow_step_kill, sync_poison_task
from bus.events import DeltaEvent as Delta
from bus.events import KeyframeEvent as Keyframe


def write_steps(fleet_dir, trainer: str, steps: list[list[str]]) -> None:
    p = fleet_dir / f"trainer-{trainer}" / "metrics" / "trainer.jsonl"
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a") as f:
        for ids in steps:
            f.write(json.dumps({"version": 1, "rollout_ids": ids}) + "\n")


def test_books_count_lost_tasks_and_rollouts_trained_twice(tmp_path):
    fleet = Fleet(tmp_path, ["nats://127.0.0.1:1"])
    tasks = ["t1", "t2", "t3"]
    write_steps(tmp_path, "A", [["t1-0", "t1-1", "t2-0"]])
    b = fleet.books(tasks)
    assert (b.lost, b.duplicates_trained) == (2, 0)  # t2 half trained, t3 not at all
    write_steps(tmp_path, "B", [["t2-1", "t3-0", "t3-1", "t1-0"]])  # the standby reuses t1-0
    b = fleet.books(tasks)
    assert (b.lost, b.duplicates_trained, b.trained) == (0, 1, 6) and not b.ok()
    write_steps(tmp_path, "B", [["t1-0"]])
    assert fleet.books(tasks).duplicates_trained == 2


def test_books_keep_consumed_and_trained_apart(tmp_path):
    """A weight-0 sample (stale, a group of one) is consumed, not trained: it must not count as
    trained, and it is not lost either (the trainer used it up on purpose)."""
    fleet = Fleet(tmp_path, ["nats://127.0.0.1:1"])
    p = tmp_path / "trainer-A" / "metrics" / "trainer.jsonl"
    p.parent.mkdir(parents=True)
    p.write_text(
        json.dumps(
            {
                "version": 1,
                "rollout_ids": ["t1-0", "t1-1", "t2-0", "t2-1"],
                "trained_ids": ["t1-0", "t1-1"],
                "dropped_ids": ["t2-0", "t2-1"],
            }
        )
        + "\n"
        + json.dumps({"version": 1, "eval_success": 0.5})
        + "\n"
    )  # an eval line: no batch
    b = fleet.books(["t1", "t2"])
    assert (b.lost, b.duplicates_trained, b.consumed, b.trained, b.dropped) == (0, 0, 4, 2, 2)
    r = row("x", b, 1.0, True)
    assert (r["trained"], r["dropped"], r["consumed"]) == (2, 2, 4) and r["passed"]


def kf(v, epoch, digest):
    return Keyframe(version=v, epoch=epoch, digest=digest, trainer_id="t", codec="k", size=0, model_config={})


def dl(a, b, epoch, digest):
    return Delta(
        from_version=a,
        to_version=b,
        epoch=epoch,
        codec="d",
        size=0,
        base_digest="",
        new_digest=digest,
        trainer_id="t",
    )


def test_books_leave_out_versions_a_later_epoch_rolled_back(tmp_path):
    """checkpoint_every > 1: a leader killed after v4 (checkpointed v3) logged v4; the next epoch
    resumed from v3 and trained v4's rollouts again. Only that line leaves the books; a later
    epoch's first line of a batch that trained nothing (version kept) rolls back nothing; a
    rollout in two lines of the surviving line still counts as trained twice."""
    from bench.chaoskit.books import all_step_lines, rolled_back, tally

    ids = {t: [f"{t}-{i}" for i in range(GROUP)] for t in "abcdef"}
    lines = [(1, v, t, GROUP) for v, t in ((1, "a"), (2, "b"), (3, "c"), (4, "d"))] + [
        (2, 4, "d", GROUP),
        (2, 5, "e", GROUP),
        (3, 5, "f", 0),
    ]
    p = tmp_path / "trainer-A" / "metrics" / "trainer.jsonl"
    p.parent.mkdir(parents=True)
    p.write_text(
        "".join(
            json.dumps({"epoch": e, "version": v, "rollout_ids": ids[t], "live_samples": live}) + "\n"
            for e, v, t, live in lines
        )
    )
    gone = rolled_back(all_step_lines(tmp_path))
    assert [(d["epoch"], d["version"]) for d in gone] == [(1, 4)]
    b = tally(tmp_path, list("abcdef"))
    assert b.lost == 0 and b.duplicates_trained == 0 and b.consumed == 6 * GROUP
    with open(p, "a") as f:  # the same batch twice in the surviving line: caught
        f.write(json.dumps({"epoch": 3, "version": 6, "rollout_ids": ids["e"], "live_samples": GROUP}) + "\n")
    assert tally(tmp_path, list("abcdef")).duplicates_trained == GROUP


def test_version_line_sees_gaps_forks_and_late_deltas():
    clean = [kf(0, 1, "d0"), dl(0, 1, 1, "d1"), dl(1, 2, 1, "d2"), kf(2, 2, "d2"), dl(2, 3, 2, "d3")]
    assert version_line(clean) == {"top": 3, "gaps": [], "forks": [], "late_old_epoch": 0, "epochs": [1, 2]}
    gap = [kf(0, 1, "d0"), dl(0, 1, 1, "d1"), dl(2, 3, 1, "d3")]
    assert version_line(gap)["gaps"] == [2]
    # a deposed leader (epoch 1) wakes up after epoch 2's keyframe and publishes a different v3
    forked = clean + [dl(2, 3, 1, "other")]
    line = version_line(forked)
    assert line["forks"] == [3] and line["late_old_epoch"] == 1


@pytest.mark.timeout(400)
async def test_bad_events_and_poison_task_park_in_dlq_while_training_goes_on(tmp_path):
    r = await bad_input(tmp_path, tasks=16)
    assert r["lost"] == 0 and r["duplicates_trained"] == 0, r
    assert r["dlq"] == r["bad_events"] + GROUP and r["poison_parked"] == GROUP, r
    assert r["passed"], r


@pytest.mark.timeout(300)
async def test_sync_poison_task_short(tmp_path):
    """Short default-suite run of the sync_poison_task scenario."""
    r = await sync_poison_task(tmp_path, tasks=2, timeout_s=5.0)
    assert r["lost"] == 0 and r["duplicates_trained"] == 0, r
    assert r["versions"] >= 2 and r["sync_replaced"] >= 1 and r["poison_parked"] == GROUP, r
    assert r["passed"], r


@pytest.mark.timeout(300)
async def test_slow_step_kill_short(tmp_path):
    """Short default-suite run of the slow_step_kill scenario."""
    r = await slow_step_kill(tmp_path, tasks=16)
    assert r["lost"] == 0 and r["duplicates_trained"] == 0, r
    assert r["version_at_kill"] == 0 and r["leader_logged_steps"] == 0, r
    assert r["passed"], r
