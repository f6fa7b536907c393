"""Teacher-forced rows for the learner: one sequence per row (plain causal), or the completions
of one prompt packed behind a single copy of it.

A GRPO group is G completions of one prompt. Run as G rows, the prompt's tokens go through the
model G times, forward and backward; with a chat template the prompt is often longer than the
completion, so most of a step's compute is that repetition. Packed, a row holds the prompt once
and then each completion, and each completion token attends to the prompt and to the earlier
tokens of its own completion only, at the positions it had when it was sampled:

    row:   p0 p1 p2 | a0 a1 a2 | b0 b1
    pos:    0  1  2 |  3  4  5 |  3  4
    b1 sees p0 p1 p2 b0 b1, not a0 a1 a2.

The same attention, the same positions, so the same logprobs and gradients as one row each, up
to the order floating-point sums take. The first token of every completion is predicted from the
last prompt position: one hidden state, gathered G times."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Rows:
    """What the forward takes and where each completion token's prediction is.

    idx [R, L] token ids; pos/mask None (plain causal) or pos [R, L] position in its own sequence
    and mask [R, L, L] bool (True: the query may attend to the key). Per completion token, in
    sample order then token order ([N]): `row`/`at` index the hidden state that predicts it,
    `target` is the token."""

    idx: torch.Tensor
    pos: torch.Tensor | None
    mask: torch.Tensor | None
    row: torch.Tensor
    at: torch.Tensor
    target: torch.Tensor


def one_per_row(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], dev) -> Rows:
    """Each sequence in its own row, right-padded (padding is never seen: causal)."""
    plen = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    clen = torch.tensor([len(c) for c in completions], dtype=torch.long)
    B, L = len(prompts), int((plen + clen).max()) if len(prompts) else 0
    idx = torch.zeros(B, L, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        idx[i, : len(p) + len(c)] = torch.as_tensor(list(p) + list(c), dtype=torch.long)
    row = torch.arange(B).repeat_interleave(clen)
    j = _within(clen)  # completion token j is predicted at plen - 1 + j
    at = plen[row] - 1 + j
    return Rows(idx.to(dev), None, None, row.to(dev), at.to(dev), idx[row, at + 1].to(dev))


def prompt_units(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], max_row: int = 0
) -> list[list[int]]:
    """Indices of the sequences that share a packed row: those with one prompt, in order, split
    where a row would pass `max_row` tokens (0: no cap; a sequence longer than the cap goes
    alone). Attention over a packed row is [L, L], so the cap bounds its memory."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(tuple(p), []).append(i)
    units = []
    for p, members in by_prompt.items():
        unit, length = [], len(p)
        for i in members:
            n = len(completions[i])
            if unit and max_row and length + n > max_row:
                units.append(unit)
                unit, length = [], len(p)
            unit.append(i)
            length += n
        units.append(unit)
    return units


def shared_prompts(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], dev, max_row: int = 0
) -> Rows:
    """The sequences of each prompt unit (prompt_units) packed into one row behind one copy of
    the prompt (module doc)."""
    units = prompt_units(prompts, completions, max_row)
    R = len(units)
    lens = [len(prompts[m[0]]) + sum(len(completions[i]) for i in m) for m in units]
    L = max(lens, default=0)
    idx = torch.zeros(R, L, dtype=torch.long)
    pos = torch.zeros(R, L, dtype=torch.long)
    seg = torch.full((R, L), -1, dtype=torch.long)  # 0 prompt, k + 1 its k-th completion, -1 padding
    row = torch.zeros(len(prompts), dtype=torch.long)  # each sequence's packed row
    start = torch.zeros(len(prompts), dtype=torch.long)  # where its completion begins in that row
    for r, members in enumerate(units):
        p = prompts[members[0]]
        P = len(p)
        idx[r, :P], pos[r, :P], seg[r, :P] = torch.tensor(p, dtype=torch.long), torch.arange(P), 0
        at = P
        for k, i in enumerate(members):
            c = completions[i]
            idx[r, at : at + len(c)] = torch.as_tensor(list(c), dtype=torch.long)
            pos[r, at : at + len(c)] = torch.arange(P, P + len(c))
            seg[r, at : at + len(c)] = k + 1
            row[i], start[i] = r, at
            at += len(c)
    q, k = seg[:, :, None], seg[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    # a key is visible if it is earlier and is the prompt or the query's own completion; padding
    # sees the prompt and itself (a row with no visible key would softmax to NaN)
    mask = causal & ((k == 0) | (k == q))
    clen = torch.tensor([len(c) for c in completions], dtype=torch.long)
    plen = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    seq = torch.arange(len(prompts)).repeat_interleave(clen)
    j = _within(clen)
    tok_row = row[seq]
    # token 0 from the prompt's last position, token j > 0 from its own token j - 1
    at = torch.where(j == 0, plen[seq] - 1, start[seq] + j - 1)
    target = idx[tok_row, start[seq] + j]
    return Rows(idx.to(dev), pos.to(dev), mask.to(dev), tok_row.to(dev), at.to(dev), target.to(dev))


def _within(lengths: torch.Tensor) -> torch.Tensor:
    """0..n-1 for each length n, concatenated: each flat token's index within its sequence."""
    first = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) - first.repeat_interleave(lengths)
