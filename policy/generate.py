"""Static-batch generation with the KV cache (evaluation, lambda calibration, tests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .model import KVCache, Transformer
from .sampling import SamplingConfig, SamplingMask, sample


@dataclass
class GenOut:
    ids: list[int]  # completion ids (the stop id included when it ended the sequence)
    logprobs: list[float]  # behaviour logprob of each id
    mask: SamplingMask  # one row per id
    finish_reason: str  # "stop" | "stop_fn" | "length"


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig | Sequence[SamplingConfig],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    stop_fn: Callable[[list[int]], bool] | None = None,
) -> list[GenOut]:
    """`stop_fn(ids so far)` true ends a sequence too (finish "stop_fn"): e.g. a closed action block."""
    B = len(prompts)
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    cfgs = [sampling] * B if isinstance(sampling, SamplingConfig) else list(sampling)
    if len(cfgs) != B:
        raise ValueError(f"got {len(cfgs)} sampling configs for {B} prompts")
    dev = next(model.parameters()).device
    cache = KVCache(
        model.cfg,
        B,
        max(len(p) for p in prompts) + max_new_tokens,
        dtype=next(model.parameters()).dtype,
        device=dev,
    )
    logits = model.prefill_many(prompts, cache, list(range(B)))
    ids, lps, masks = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    finish = [None] * B
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=dev)
    active = torch.arange(B, device=dev)
    for step in range(max_new_tokens):
        out = sample(logits, [cfgs[i] for i in active.tolist()], generator)
        for i, tok, lp, row in zip(
            active.tolist(), out.tokens.tolist(), out.logprobs.tolist(), out.mask.row_parts()
        ):
            ids[i].append(tok)
            lps[i].append(lp)
            masks[i].append(row)
        done = torch.isin(out.tokens, stop)
        for i in active[done].tolist():
            finish[i] = "stop"
        if stop_fn is not None:
            ended = [j for j, i in enumerate(active.tolist()) if finish[i] is None and stop_fn(ids[i])]
            for j in ended:
                finish[active[j].item()] = "stop_fn"
            if ended:
                done = done.clone()
                done[ended] = True
        keep = ~done
        if step == max_new_tokens - 1 or not keep.any():
            break
        active, tokens = active[keep], out.tokens[keep]
        logits = model.decode(tokens, cache, active)
    return [GenOut(ids[i], lps[i], SamplingMask.from_rows(masks[i]), finish[i] or "length") for i in range(B)]
