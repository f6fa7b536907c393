"""Trainer test helpers: a tiny trainer config, scored rollouts to feed it, groups of them published
on the bus."""

from __future__ import annotations

import random

import torch

from bus import BusConfig
from bus import topology as topo
from bus.events import Rollout, Scored
from policy.config import ModelConfig
from policy.logprobs import sequence_logprobs
from policy.model import Transformer
from policy.sampling import SamplingConfig, SamplingMask
from trainer.config import TrainerConfig

MODEL = ModelConfig.tiny(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64).to_dict()


def make_scored(
    model,
    task_id: str,
    i: int,
    group_size: int,
    version: int,
    rng: random.Random,
    T: int = 6,
    reward=None,
    mask=None,
) -> Scored:
    """A rollout whose behaviour logprobs are the model's own (ratio 1 at the current weights)."""
    prompt = [1] + [rng.randrange(3, 50) for _ in range(4)]
    comp = [rng.randrange(3, 50) for _ in range(T)]
    with torch.no_grad():
        lp = sequence_logprobs(model, [prompt], [comp], SamplingConfig(temperature=1.0)).logprobs[0]
    reward = float(sum(c % 2 for c in comp) / T) if reward is None else reward
    r = Rollout(
        rollout_id=f"{task_id}-{i}",
        task_id=task_id,
        env="arith",
        sample_index=i,
        group_size=group_size,
        prompt="p",
        spec={},
        prompt_ids=prompt,
        completion_ids=comp,
        completion_text="c",
        logprobs=[float(x) for x in lp],
        token_versions=[version] * T,
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": T, "n": group_size},
        sampling_mask=mask if mask is not None else SamplingMask.full(T).to_wire(),
        quant={},
        finish_reason="length",
        cost_tokens=T,
        wall_s=0.1,
        worker_id="w",
    )
    return Scored(rollout=r.to_dict(), success=reward, cost=float(T), lambda_=0.0, penalty=0.0, reward=reward)


async def publish_groups(bus, model, n_groups, group_size, version=0, prefix="t", seed=0):
    rng = random.Random(seed)
    for g in range(n_groups):
        for i in range(group_size):
            await bus.publish(
                topo.scored_subject("arith"), make_scored(model, f"{prefix}{g}", i, group_size, version, rng)
            )


def trainer_config(url, tmp_path, **kw) -> TrainerConfig:
    """A tiny trainer's config; a section given in `kw` (a dict) is merged key by key into the base's."""
    base = dict(
        bus=BusConfig(servers=[url], name="trainer-test"),
        trainer_id="T1",
        policy={"model": MODEL},
        batch={"groups": 2, "group_size": 4, "fetch_timeout_s": 0.2},
        tasks={"feed": False},
        optim={"lr": 1e-2},
        checkpoint={"dir": str(tmp_path / "ckpt")},
        run={"dir": str(tmp_path / "run")},
        lease={"ttl_s": 3.0},
    )
    merged = {
        k: {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
        for k, v in kw.items()
    }
    return TrainerConfig(**{**base, **merged})


async def publish_group(bus, task: str, n: int = 2, seed: int = 0) -> list[str]:
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(seed)
    ids = []
    for i in range(n):
        sc = make_scored(model, task, i, n, 0, rng)
        ids.append(sc.rollout["rollout_id"])
        await bus.publish(topo.scored_subject("arith"), sc)
    return ids
