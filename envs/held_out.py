"""Held-out episodes: which eval specs a pass takes (`eval_specs`), and a model playing them, all
in lockstep, turn by turn, in the calling process (`play_held_out`). The trainer's held-out eval,
`asyncrl tasks predict` and `asyncrl calibrate-cost` on episodes play them through here, so
they measure the same thing on the same policy."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import numpy as np
import torch

from policy import SamplingConfig

from . import get_env
from .conversation import chat_format
from .episode import Episode, EpisodeLimits, EpisodeTask
from .episode_play import play_episode
from .episode_pool import InlinePool
from .lockstep import Lockstep, LockstepPlayer


def eval_specs(env_names: list[str], n: int, seed: int, split: str = "eval"):
    """n (env, TaskSpec) pairs, the envs in turn. An env with a finite split (`split_specs`) gives
    each of its tasks in turn, in a seeded order, so every task counts once per pass (random draws
    from 36 tasks left some out and doubled others: the eval moved with the draw, not the policy);
    any other env draws at random."""
    rng = random.Random(seed)
    envs = [get_env(name) for name in env_names]
    orders: dict[int, list] = {}
    out = []
    for i in range(n):
        k = i % len(envs)
        env = envs[k]
        if hasattr(env, "split_specs"):
            if k not in orders:
                orders[k] = list(env.split_specs(split))
                random.Random(seed + k).shuffle(orders[k])
            order = orders[k]
            out.append((env, order[(i // len(envs)) % len(order)]))
        else:
            out.append((env, env.sample(rng, split=split)))
    return out


def play_held_out(model, tok, specs: list[dict], sc: SamplingConfig, seed: int = 0, on_scored=None) -> dict:
    """Play one episode per spec with `model`, all in lockstep (envs/lockstep.py): each round
    generates the next turn of every live episode in one batch (from the whole conversation so far,
    laid out as the worker lays it out: envs.conversation), cut at the closing fence of its bash
    block, and steps it in the sandbox. Success = resolved (every hidden test passes).
    `on_scored(episode, result)`: called for each episode once scored, before its workspace goes
    (`asyncrl tasks predict` reads the agent's change there)."""
    eps = []
    for spec in specs:
        lim = EpisodeLimits(**spec["limits"])
        room = model.cfg.max_seq_len - lim.max_turn_tokens - 1  # a turn always fits the model
        # no episode wall clock: in lockstep an episode's clock counts every other episode's
        # generation, so held-out success would depend on the eval batch and the box's load
        # (turns, tokens and each command's own limit still bound an episode)
        lim = dataclasses.replace(
            lim, max_context_tokens=max(1, min(lim.max_context_tokens, room)), episode_wall_s=float("inf")
        )
        eps.append(
            Episode(EpisodeTask.from_dict(spec["episode"]), lim, token_counter=lambda t: len(tok.encode(t)))
        )
    fmt, env = chat_format(tok), InlinePool()
    rounds = Lockstep(model, tok, sc, torch.Generator().manual_seed(seed), len(eps))

    async def play(i: int, ep: Episode) -> None:
        try:
            await play_episode(
                ep, env, LockstepPlayer(rounds, i, ep.limits.max_turn_tokens), fmt, tok, model.cfg.max_seq_len
            )
        finally:
            rounds.leave()

    async def play_all() -> None:
        await asyncio.gather(*(play(i, ep) for i, ep in enumerate(eps)))

    try:
        asyncio.run(play_all())
        results = [ep.score() for ep in eps]
        if on_scored is not None:
            for ep, r in zip(eps, results):
                on_scored(ep, r)
    finally:
        for ep in eps:
            ep.close()
    out = {
        "eval_success": float(np.mean([r.resolved for r in results])),
        "eval_reward": float(np.mean([r.reward for r in results])),
        "eval_turns": float(np.mean([r.turns for r in results])),
        "eval_tool_calls": float(np.mean([r.tool_calls for r in results])),
        "eval_tokens": float(np.mean([r.tokens for r in results])),
        # the policy's tokens an episode (its turns, no prompt or observations): a cost in tokens
        "eval_model_tokens": float(np.mean([ep.action_tokens for ep in eps])),
        "eval_n": len(results),
    }
    for r in results:  # termination reasons as fractions (flat numbers: the metrics stream)
        out[f"eval_term_{r.termination}"] = out.get(f"eval_term_{r.termination}", 0.0) + 1 / len(results)
    return out
