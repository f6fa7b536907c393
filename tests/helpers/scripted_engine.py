"""An engine whose replies are given: a policy that plays known turns, so a test drives the real
worker (its turn loop or a harness on its endpoint), sandbox, scoring and scorer to a known verdict."""

from __future__ import annotations

import itertools

import policy
from rollout_worker.engine import Generation


class ScriptedEngine:
    """The engine interface the worker's episodes use (generate with keep, extend, release). An
    episode whose first prompt holds a key of `scripts` gets that key's replies in order, then
    `then` for every further turn; any other episode gets `then` only. Each reply ends with eos,
    as a turn the model closed itself."""

    def __init__(self, tok, scripts: dict[str, list[str]], then: str, max_len: int = 1 << 15):
        self.tok, self.scripts, self.then, self.max_len = tok, scripts, then, max_len
        self.version, self.epoch = 0, 0
        self.kept: dict[int, list[str]] = {}
        self.replies: list[str] = []  # every reply given, in order
        self._handles = itertools.count()

    @property
    def free_slots(self) -> int:
        return 8 - len(self.kept)

    def _reply(self, script: list[str], handle: int) -> Generation:
        text = script.pop(0) if script else self.then
        self.replies.append(text)
        ids = self.tok.encode(text) + [self.tok.eos_id]
        n = len(ids)
        mask = policy.SamplingMask.full(n).to_wire()
        return Generation(ids, [-0.5] * n, [self.version] * n, mask, "stop", 0.0, self.epoch, {}, handle)

    async def generate(self, prompt_ids, sampling, seed, keep: bool = False, stop_seqs=None) -> Generation:
        text = self.tok.decode(prompt_ids)
        script = next((list(v) for k, v in self.scripts.items() if k in text), [])
        handle = next(self._handles) if keep else -1
        if keep:
            self.kept[handle] = script
        return self._reply(script, handle)

    async def extend(self, handle: int, ids, sampling, stop_seqs=None) -> Generation:
        if handle not in self.kept:
            raise ValueError(f"no kept sequence {handle}")
        return self._reply(self.kept[handle], handle)

    def release(self, handle: int) -> None:
        self.kept.pop(handle, None)

    async def load_keyframe(self, state, version: int, epoch: int) -> None:
        self.version, self.epoch = version, epoch

    async def apply_delta(self, delta, epoch: int) -> None:
        self.version, self.epoch = delta.to_version, epoch

    def stats(self) -> dict:
        return {"kept": len(self.kept)}

    async def close(self) -> None:
        self.kept.clear()
