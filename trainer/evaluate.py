"""Held-out evaluation: the published (bf16) policy on the eval split, as workers would sample it.

Reports success and tokens per answer on a fixed set of eval prompts, so runs and versions
are comparable (same prompts, same sampling seed). Multi-turn envs (a spec with an `episode`) are
played as episodes, turn by turn, in this process (envs/held_out.py)."""

from __future__ import annotations

import numpy as np
import torch

from envs.feeder import prompt_ids
from envs.held_out import eval_specs, play_held_out
from policy import SamplingConfig, Transformer, generate


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
        return play_held_out(model, tok, [s.spec for _, s in specs], sc, seed)
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
