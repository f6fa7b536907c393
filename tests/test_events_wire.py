"""The wire format of every bus event is fixed: bodies written by an earlier build (stored streams,
other readers, the NATS CLI view) are byte for byte what this build writes, and they decode to
equal events. tests/data/events_golden.json holds the bytes (hex) that the build before the port to
msgspec wrote for the events built here; key order inside the maps is part of the format."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from bus.events import (
    DeltaEvent,
    Heartbeat,
    KeyframeEvent,
    ManifestEvent,
    Metrics,
    Rollout,
    SamplingParams,
    Scored,
    Task,
    decode,
    encode,
)

GOLDEN = Path(__file__).parent / "data" / "events_golden.json"
TS = 1_765_000_000.123456


def sampling_dict(sp: SamplingParams) -> dict:
    return msgspec.structs.asdict(sp)


def rollout(**over) -> Rollout:
    fields = dict(
        rollout_id="t-42-1",
        task_id="t-42",
        env="arith",
        sample_index=1,
        group_size=4,
        prompt="12+30= λ ✓",
        spec={"answer": "42", "tests": ["a", "b"], "n": 3, 7: [1.5, None, True]},
        prompt_ids=[1, 300, 70000, 5],
        completion_ids=[52, 50, 2],
        completion_text="#42",
        logprobs=[-0.125, -3.5e-05, -12.75],
        token_versions=[3, 3, 4],
        sampling=sampling_dict(SamplingParams(temperature=0.7, top_p=0.95, max_tokens=48, n=4)),
        sampling_mask={"format": "full", "rows": 3},
        quant={},
        finish_reason="stop",
        cost_tokens=3,
        wall_s=0.25,
        worker_id="w-0",
    )
    return Rollout(**{**fields, **over})


def events() -> dict[str, object]:
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_tokens=128, n=4, stop=[2, 13])
    episode = rollout(
        rollout_id="e-7-0",
        task_id="e-7",
        env="swe",
        sample_index=0,
        completion_ids=[11, 12, 900, 901, 13, 2],
        logprobs=[-0.5, -0.25, 0.0, 0.0, -1.0, -0.0625],
        token_versions=[5, 5, -1, -1, 6, 6],
        loss_mask=[1, 1, 0, 0, 1, 1],
        cost_tokens=4,
        finish_reason="length",
        turns=2,
        tool_calls=1,
        termination="submitted",
        episode={"resolved": False, "passed": 3, "total": 4, "turns": [{"cmd": "ls", "rc": 0}]},
        lambda_=0.002,
        epoch=2,
        split="eval",
        wall_s=123.5,
    )
    return {
        "task_defaults": Task(task_id="t-1", env="arith", prompt="1+1=", created_at=TS),
        "task_sampling": Task(
            task_id="t-2",
            env="swe",
            prompt="fix the bug",
            spec={"episode": {"repo": "x/y", "files": {"a.py": "print(1)\n"}}, "answer": -1},
            sampling=sampling_dict(sp),
            split="eval",
            min_version=7,
            created_at=TS,
            lambda_=0.01,
        ),
        "rollout": rollout(),
        "rollout_episode": episode,
        "scored": Scored(
            rollout=rollout().to_dict(),
            success=1.0,
            cost=3.0,
            lambda_=0.002,
            penalty=0.006,
            reward=0.994,
            reason="ok",
            cost_wall_s=0.25,
            tool_calls=0,
            scorer_id="s-0",
            score=1.0,
            shaping=0.0,
        ),
        "scored_older": Scored(
            rollout=episode.to_dict(),
            success=0.0,
            cost=4.0,
            lambda_=0.0,
            penalty=-0.5,
            reward=0.5,
            infra="sandbox",
            tampered=True,
        ),
        "delta": DeltaEvent(
            epoch=3,
            codec="zstd-xor-v3",
            size=5,
            signature=b"\x01" * 64,
            payload=b"\x00\xffabc",
            trainer_id="tr-0",
            from_version=6,
            to_version=7,
            base_digest="ab" * 16,
            new_digest="cd" * 16,
            changed_frac=0.03125,
        ),
        "delta_blob": DeltaEvent(
            epoch=3,
            codec="zstd-xor-v3",
            size=1 << 33,
            blob="delta-e3-v8",
            from_version=7,
            to_version=8,
            base_digest="cd" * 16,
            new_digest="ef" * 16,
        ),
        "keyframe": KeyframeEvent(
            epoch=1,
            codec="raw",
            size=300,
            blob="kf-1-0",
            version=0,
            digest="00" * 32,
            model_config={"dim": 64, "n_layers": 2, "vocab_size": 128, "norm_eps": 1e-05, "tied": True},
        ),
        "manifest": ManifestEvent(
            epoch=4,
            codec="sharded",
            size=900,
            signature=b"s" * 64,
            payload=b"m" * 40,
            trainer_id="tr-1",
            from_version=10,
            to_version=11,
            parts=2,
            part_bytes=123_456_789,
            model_config={"dim": 64},
            changed_frac=1.0,
        ),
        "heartbeat": Heartbeat(
            component="rollout_worker",
            component_id="w-0",
            ts=TS,
            version=12,
            metrics={"tokens_per_s": 1234.5, "inflight": 3, "errors": {"nan": 0}, "up": True, "neg": -70000},
        ),
        "heartbeat_defaults": Heartbeat(component="trainer", component_id="tr-0", ts=TS),
        "metrics": Metrics(
            component="trainer",
            component_id="tr-0",
            step=9,
            values={"loss": -0.015625, "kl": 1e-300, "big": 2**64 - 1, "neg": -(2**63), "s": "x" * 40},
            ts=TS,
        ),
    }


def golden() -> dict[str, dict[str, str]]:
    return json.loads(GOLDEN.read_text())


def test_every_event_kind_is_covered():
    kinds = {golden()[name]["kind"] for name in golden()}
    assert kinds == {"Task", "Rollout", "Scored", "Delta", "Keyframe", "Manifest", "Heartbeat", "Metrics"}
    assert set(golden()) == set(events())


@pytest.mark.parametrize("name", sorted(events()))
def test_encode_is_byte_identical_to_the_stored_body(name):
    ev = events()[name]
    stored = golden()[name]
    assert stored["kind"] == ev.KIND
    assert encode(ev).hex() == stored["hex"]


@pytest.mark.parametrize("name", sorted(events()))
def test_the_stored_body_decodes_to_an_equal_event(name):
    ev = events()[name]
    body = bytes.fromhex(golden()[name]["hex"])
    assert decode(body) == ev
    assert decode(body, type(ev)) == ev
    if isinstance(ev, Scored):
        assert ev.get_rollout() == decode(body, Scored).get_rollout()


def test_float_subclasses_encode_as_floats():
    """numpy's float64 is a float: msgpack wrote it as one, so does the msgspec encoder."""
    computed = rollout(wall_s=np.float64(0.25), logprobs=[np.float64(-0.125), -3.5e-05, -12.75])
    assert encode(computed) == encode(rollout())
