"""The rollout worker with engine="vllm" on a real nats-server: the model comes from a published
keyframe (policy names, Llama layout, no HF dir given), a delta lands mid-generation, and every
behaviour logprob is what policy/ gives at the token's recorded version (the trainer's replay)."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm")

import policy  # noqa: E402
from bus import topology as topo  # noqa: E402
from bus.events import Rollout  # noqa: E402
from bus.weights.publisher import WeightPublisher  # noqa: E402
from rollout_worker.worker import Worker  # noqa: E402
from tests.helpers.engine import reference_logprobs  # noqa: E402
from tests.helpers.weights import delta, until  # noqa: E402
from tests.helpers.worker import CFG, TOK, publish_tasks, read_stream, states_for, worker_cfg  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ATOL, RTOL = 0.08, 0.05  # bf16 vLLM kernels vs policy's fp32 replay on the same bf16 weights


async def test_vllm_worker_hot_patches_and_replays(bus, fresh_server):
    states = [{k: v.to(torch.bfloat16) for k, v in s.items()} for s in states_for(2, seed=7)]
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    await pub.publish_keyframe(states[0], 0, CFG)
    worker, stop = Worker(worker_cfg(fresh_server.url, engine={"kind": "vllm"}), bus), asyncio.Event()
    run = asyncio.create_task(worker.run(stop, handle_signals=False))
    ids = await publish_tasks(bus, 4, "vllm", max_tokens=60)
    await until(lambda: worker.engine is not None and worker.engine.stats()["tokens"] > 20, timeout=300)
    await pub.publish_delta(delta(states, 0, 1))
    await until(lambda: worker.tasks_done == len(ids), timeout=120)
    stop.set()
    await run

    rollouts = await read_stream(bus, topo.ROLLOUTS, Rollout)
    on_v1, old_ref_v1 = [], []
    assert sorted(r.rollout_id for r in rollouts) == sorted(f"{t}-{i}" for t in ids for i in range(2))
    for r in rollouts:
        assert len(r.completion_ids) == len(r.logprobs) == len(r.token_versions) == r.cost_tokens > 0
        assert r.token_versions == sorted(r.token_versions) and r.epoch == 1
        assert r.prompt_ids == TOK.encode(r.prompt, bos=True) and r.finish_reason in ("stop", "length")
        ref = reference_logprobs(
            {0: states[0], 1: states[1]}, r.prompt_ids, r.completion_ids, r.token_versions, cfg=CFG
        )
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=ATOL, rtol=RTOL)
        if 1 in r.token_versions:  # negative control: the same tokens replayed on v0 only
            old = reference_logprobs(
                {0: states[0]}, r.prompt_ids, r.completion_ids, [0] * len(r.completion_ids), cfg=CFG
            )
            at_v1 = torch.tensor(r.token_versions) == 1
            on_v1.append(torch.tensor(r.logprobs)[at_v1])
            old_ref_v1.append(old[at_v1])
        assert policy.SamplingMask.from_wire(r.sampling_mask).counts.size == len(r.completion_ids)
    assert any(1 in r.token_versions for r in rollouts)
    # the tolerance above is tighter than the old-vs-new weights gap: v1 tokens replayed on v0 fail it
    got, wrong = torch.cat(on_v1), torch.cat(old_ref_v1)
    assert not torch.allclose(got, wrong, atol=ATOL, rtol=RTOL)
    assert (got - wrong).abs().mean() > 2 * ATOL, (got - wrong).abs().mean()
    assert any(len(set(r.token_versions)) > 1 for r in rollouts)  # the delta landed mid-sequence
    st = worker.snapshot()
    assert st["version"] == 1 and st["tokens_per_s"] > 0 and st["updates"] >= 1
