"""Held-out evaluation: the published (bf16) policy on the eval split, as workers would sample it.

Reports success and tokens per answer on a fixed set of eval prompts, so runs and versions
are comparable (same prompts, same sampling seed). Multi-turn envs (a spec with an `episode`) are
played as episodes, turn by turn, in this process (`evaluate_episodes`)."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import numpy as np
import torch

from envs import get_env
from envs.feeder import prompt_ids
from policy import SamplingConfig, Transformer, generate


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


@torch.no_grad()
def evaluate(
    published: dict,
    model_cfg,
    tok,
    env_names: list[str],
    sampling: dict,
    n: int = 128,
    seed: int = 0,
    chat_template: bool = False,
) -> dict:
    model = Transformer(model_cfg).float()
    model.load_inference_state(published)  # exactly the bits the workers hold
    model.eval()
    return evaluate_model(model, tok, env_names, sampling, n, seed, chat_template)


@torch.no_grad()
def evaluate_model(
    model,
    tok,
    env_names: list[str],
    sampling: dict,
    n: int,
    seed: int = 0,
    chat_template: bool = False,
    split: str = "eval",
) -> dict:
    """`model` (in eval mode) on n tasks of `split`: episodes for multi-turn envs, else one answer each."""
    specs = eval_specs(env_names, n, seed, split)
    sc = SamplingConfig.from_dict(sampling)
    if all("episode" in s.spec for _, s in specs):
        return evaluate_episodes(model, tok, [s.spec for _, s in specs], sc, seed)
    outs = generate(
        model,
        prompt_ids(tok, [s.prompt for _, s in specs], chat_template),
        sc,
        int(sampling.get("max_tokens", 64)),
        [tok.eos_id],
        torch.Generator().manual_seed(seed),
    )
    success, tokens = [], []
    for (env, spec), o in zip(specs, outs):
        ids = o.ids[:-1] if o.finish_reason == "stop" else o.ids
        success.append(env.verify(tok.decode(ids), spec.spec).success)
        tokens.append(len(o.ids))
    return {"eval_success": float(np.mean(success)), "eval_tokens": float(np.mean(tokens)), "eval_n": n}


def evaluate_episodes(
    model, tok, specs: list[dict], sc: SamplingConfig, seed: int = 0, on_scored=None
) -> dict:
    """Play one episode per spec with `model`, all in lockstep (trainer/lockstep.py): each round
    generates the next turn of every live episode in one batch (from the whole conversation so far,
    laid out as the worker lays it out: envs.conversation), cut at the closing fence of its bash
    block, and steps it in the sandbox. Success = resolved (every hidden test passes).
    `on_scored(episode, result)`: called for each episode once scored, before its workspace goes
    (`asyncrl tasks predict` reads the agent's change there)."""
    from envs.conversation import chat_format
    from envs.episode import Episode, EpisodeLimits, EpisodeTask
    from envs.episode_play import play_episode
    from envs.episode_pool import InlinePool

    from .lockstep import Lockstep, LockstepPlayer

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
        "eval_n": len(results),
    }
    for r in results:  # termination reasons as fractions (flat numbers: the metrics stream)
        out[f"eval_term_{r.termination}"] = out.get(f"eval_term_{r.termination}", 0.0) + 1 / len(results)
    return out
