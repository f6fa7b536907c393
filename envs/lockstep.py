"""Episodes played in lockstep on one model (the held-out eval): each round generates the next turn
of every episode still playing in one batch, then each steps its own episode.

Every episode runs envs/episode_play.py's turn loop with a LockstepPlayer; a player's turn waits
until each episode still playing waits on its turn too (or has ended), then the whole round is
generated at once, in episode order, from one seeded generator (so a pass is reproducible).
"""

from __future__ import annotations

import asyncio

from policy import SamplingConfig, generate

from .actions import BASH_BLOCK
from .episode_play import Turn


class Lockstep:
    """The rounds: turn requests gathered until every episode still playing has one in."""

    def __init__(self, model, tok, sc: SamplingConfig, gen, players: int):
        self.model, self.tok, self.sc, self.gen, self.playing = model, tok, sc, gen, players
        self.waiting: dict[int, tuple[list[int], int, asyncio.Future]] = {}

    def closed(self, ids: list[int]) -> bool:  # a turn ends with its bash block, as on the workers
        return "`" in self.tok.decode(ids[-1:]) and BASH_BLOCK.search(self.tok.decode(ids)) is not None

    async def generate(self, i: int, ids: list[int], max_tokens: int):
        """Episode i's next turn after `ids` (policy GenOut), generated in the round it joins."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting[i] = (ids, max_tokens, fut)
        self.round()
        return await fut

    def leave(self) -> None:
        """An episode ended: the rounds no longer wait for it."""
        self.playing -= 1
        self.round()

    def round(self) -> None:
        if not self.waiting or len(self.waiting) < self.playing:
            return
        batch, self.waiting = sorted(self.waiting.items()), {}
        try:
            outs = generate(
                self.model,
                [ids for _, (ids, _, _) in batch],
                self.sc,
                max(m for _, (_, m, _) in batch),
                [self.tok.eos_id],
                self.gen,
                stop_fn=self.closed,
            )
        except Exception as e:
            for _, (_, _, fut) in batch:
                fut.set_exception(e)
            return
        for (_, (_, _, fut)), o in zip(batch, outs):
            fut.set_result(o)


class LockstepPlayer:
    """One episode's side in the rounds: the sequence is the prompt, each action re-tokenised (cut
    after its bash block, no end-of-turn token) and the observations."""

    def __init__(self, lockstep: Lockstep, i: int, max_turn_tokens: int):
        self.lockstep, self.i, self.max_turn_tokens = lockstep, i, max_turn_tokens
        self.tok = lockstep.tok
        self.ids: list[int] = []

    def start(self, prompt_ids: list[int]) -> None:
        self.ids = list(prompt_ids)

    def length(self) -> int:
        return len(self.ids)

    def observe(self, ids: list[int]) -> None:
        self.ids += ids

    async def turn(self) -> Turn:
        o = await self.lockstep.generate(self.i, self.ids, self.max_turn_tokens)
        text = self.tok.decode(o.ids[:-1] if o.finish_reason == "stop" else o.ids)
        m = BASH_BLOCK.search(text)
        action = text[: m.end()] if m else text
        ids = self.tok.encode(action)
        self.ids += ids
        return Turn(action, len(ids), o.finish_reason, eos_kept=False)
