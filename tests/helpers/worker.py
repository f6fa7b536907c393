"""Rollout-worker test helpers: the worker's model and tokenizer, states per version, tasks
published and streams read back, a worker config."""

from __future__ import annotations

import torch
from nats.js.errors import NotFoundError

import policy
from bus import BusConfig
from bus import topology as topo
from bus.events import Task, decode
from rollout_worker.config import WorkerConfig
from tests.helpers.engine import perturb

TOK = policy.CharTokenizer.default()
CFG = policy.ModelConfig.tiny(vocab_size=TOK.vocab_size, max_seq_len=128)


def states_for(n: int, seed: int, frac: float = 0.3, scale: float = 0.05) -> list[dict]:
    """Big steps, so tokens from different versions have clearly different distributions."""
    torch.manual_seed(seed)
    out = [policy.inference_state(policy.Transformer(CFG))]
    for v in range(1, n):
        out.append(perturb(out[-1], frac, scale, seed=seed * 100 + v))
    return out


async def publish_tasks(bus, n: int, tag: str, *, max_tokens=40, group=2, min_version=0) -> list[str]:
    ids = [f"{tag}-{i}" for i in range(n)]
    for tid in ids:
        await bus.publish(
            topo.task_subject("arith"),
            Task(
                task_id=tid,
                env="arith",
                prompt=f"{tid}: 12+30=",
                spec={"answer": "42"},
                min_version=min_version,
                sampling={"max_tokens": max_tokens, "n": group, "temperature": 1.0},
            ),
        )
    return ids


async def read_stream(bus, stream: str, cls) -> list:
    """Every event stored in `stream` (read by sequence, consuming nothing)."""
    info = await bus.js.stream_info(stream)
    out = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        try:
            m = await bus.js.get_msg(stream, seq)
        except NotFoundError:
            continue
        out.append(decode(m.data, cls))
    return out


def worker_cfg(url: str, **kw) -> WorkerConfig:
    """A small worker's config; `kw` sets top-level keys, and a section given as a dict is merged over
    the helper's own keys of it (worker_cfg(url, engine={"kind": "vllm"}) keeps 4 slots)."""
    base = {"engine": {"slots": 4, "max_len": 128}, "run": {"heartbeat_s": 0.3, "grace_s": 2.0}}
    given = {k: kw.pop(k) for k in [k for k, v in kw.items() if isinstance(v, dict)]}
    sections = {k: {**base.get(k, {}), **given.get(k, {})} for k in {*base, *given}}
    return WorkerConfig(
        bus=BusConfig(servers=[url], name="w"),
        worker_id=kw.pop("worker_id", "w1"),
        **sections,
        **kw,
    )
