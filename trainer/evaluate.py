"""Held-out evaluation: the published (bf16) policy on the eval split, as workers would sample it.

Reports success and tokens per answer on a fixed set of eval prompts, so runs and versions
are comparable (same prompts, same sampling seed)."""
from __future__ import annotations

import random

import numpy as np
import torch

from envs import get_env
from policy import SamplingConfig, Transformer, generate


def eval_specs(env_names: list[str], n: int, seed: int):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        env = get_env(env_names[i % len(env_names)])
        out.append((env, env.sample(rng, split="eval")))
    return out


@torch.no_grad()
def evaluate(published: dict, model_cfg, tok, env_names: list[str], sampling: dict, n: int = 128,
             seed: int = 0) -> dict:
    model = Transformer(model_cfg).float()
    model.load_inference_state(published)     # exactly the bits the workers hold
    model.eval()
    specs = eval_specs(env_names, n, seed)
    sc = SamplingConfig.from_dict(sampling)
    outs = generate(model, [tok.encode(s.prompt, bos=True) for _, s in specs], sc,
                    int(sampling.get("max_tokens", 64)), [tok.eos_id], torch.Generator().manual_seed(seed))
    success, tokens = [], []
    for (env, spec), o in zip(specs, outs):
        ids = o.ids[:-1] if o.finish_reason == "stop" else o.ids
        success.append(env.verify(tok.decode(ids), spec.spec).success)
        tokens.append(len(o.ids))
    return {"eval_success": float(np.mean(success)), "eval_tokens": float(np.mean(tokens)), "eval_n": n}
