"""The turn loop of a multi-turn episode, the one both players use: the worker (its engine, a kept
KV row: rollout_worker/episodes.py) and the held-out eval (a model in lockstep: envs/lockstep.py).

    msgs   = reset                                  -> prompt ids (the conversation layout: `fmt`)
    turn   = player.turn()                          -> the action text, its token count, why it ended
    step   (the episode)                            -> observation text -> its ids
    observe                                         -> the player appends them after its turn
    until the episode ends, or the player's sequence has no room left for another turn (context_limit)

A player holds the sequence (prompt, its turns, the observations between them):

    start(prompt_ids)       the sequence begins
    await turn() -> Turn    the next turn, generated after everything so far
    observe(ids)            observation ids, appended after the turn
    length() -> int         ids in the sequence so far

`env` makes the episode's calls: EpisodePool (worker threads) or InlinePool (the caller's thread).
Scoring and closing stay with the caller (the worker frees its KV row before the scoring run).
"""

from __future__ import annotations

from dataclasses import dataclass

from .episode import Episode


@dataclass
class Turn:
    action: str  # the text the episode steps on
    n_tokens: int  # its length in tokens (the episode's turn and context budget)
    finish: str  # why generation stopped: stop (end-of-turn token) | stop_seq | length | ...
    eos_kept: bool  # the end-of-turn token is in the player's sequence (the layout leaves its text out)


async def play_episode(ep: Episode, env, player, fmt, tok, max_len: int) -> list[dict]:
    """Reset `ep` and play it turn by turn until it ends; the turn log (action, observation, finish).
    `max_len`: the ids the player's sequence can hold; a turn of max_turn_tokens must always fit,
    with one position to spare."""
    msgs = await env.reset(ep)
    prompt = tok.encode(fmt.prompt(msgs), bos=True)
    player.start(prompt)
    turn_tokens = ep.limits.max_turn_tokens
    if not ep.done and len(prompt) + 1 + turn_tokens > max_len:
        ep.end("context_limit", f"prompt of {len(prompt)} tokens > {max_len - turn_tokens - 1}")
    log: list[dict] = []
    while not ep.done:
        t = await player.turn()
        r = await env.step(ep, t.action, t.n_tokens)
        log.append({"action": t.action, "observation": r.observation, "finish": t.finish})
        if r.done:
            break
        obs = tok.encode(fmt.observation(r.observation, t.eos_kept))
        if player.length() + 1 + len(obs) + turn_tokens > max_len:
            ep.end("context_limit", "the sequence is full")
            break
        player.observe(obs)
    return log
