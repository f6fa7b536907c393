"""Short supervised warm start on the environments' demonstrations, so RL starts from a policy
with non-trivial success (0 steps by default). Teacher-forced next-token NLL of the
demonstration given the prompt, with its own AdamW so the RL optimizer state stays untouched."""
from __future__ import annotations

import random

import torch

from bus import get_logger
from envs import get_env
from policy import SamplingConfig, load_tokenizer, sequence_logprobs

from .learner import length_buckets

log = get_logger(__name__)


def demo_batch(env_names: list[str], n: int, rng: random.Random, tok, style: str = "default"):
    prompts, completions = [], []
    for i in range(n):
        env = get_env(env_names[i % len(env_names)])
        ts = env.sample(rng, split="train")
        prompts.append(tok.encode(ts.prompt, bos=True))
        completions.append(tok.encode(env.demonstration(ts.spec, style), eos=True))
    return prompts, completions


def warm_start(model, cfg, model_cfg=None, tok=None, style: str = "default") -> list[float]:
    """cfg.warmstart_steps AdamW steps of demonstration NLL; returns the loss per step."""
    tok = tok or load_tokenizer(cfg.tokenizer)
    rng = random.Random(cfg.seed + 7919)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr)
    losses = []
    model.train()
    for step in range(cfg.warmstart_steps):
        prompts, completions = demo_batch(cfg.envs, cfg.warmstart_batch, rng, tok, style)
        opt.zero_grad(set_to_none=True)
        n_tokens = sum(len(c) for c in completions)
        loss = 0.0
        # padded forwards over runs of similar length: a long-tailed env would pad all to the longest
        for run in length_buckets([len(p) + len(c) for p, c in zip(prompts, completions)], len(prompts)):
            res = sequence_logprobs(model, [prompts[i] for i in run], [completions[i] for i in run],
                                    SamplingConfig(temperature=1.0), replay_mask=False)
            part = -(res.logprobs * res.valid).sum() / n_tokens
            part.backward()
            loss += part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
        if step % 50 == 0 or step == cfg.warmstart_steps - 1:
            log.info("warm start", step=step, nll=round(losses[-1], 4))
    return losses
