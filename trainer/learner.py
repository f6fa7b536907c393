"""One learner step: recompute logprobs under the workers' sampler, PG loss, all-reduce, AdamW.

Data parallel: every rank holds the whole batch (rank 0 broadcasts it) and works on samples
i ≡ rank (mod world). Each rank's loss is its share of the global token sum over the global
token count, so summing gradients across ranks gives exactly the 1-process gradient. Gradients
are summed with one flat all-reduce (what DDP's reducer does; DDP's own hooks are not used
because policy.sequence_logprobs drives the model through its own methods, not forward()).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from policy import (QuantConfig, Replay, SamplingConfig, SamplingMask, Transformer, inference_state,
                    mismatch_metrics, sequence_logprobs)

from .loss import LossConfig, group_advantages, pg_loss


@dataclass
class PackedSample:
    """What a rank needs of one scored rollout (small, picklable: broadcast to all ranks)."""
    rollout_id: str
    group: int
    reward: float
    weight: float
    lag: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    sampling: dict
    sampling_mask: dict
    quant: dict
    success: float = 0.0
    cost: float = 0.0
    lambda_: float = 0.0


def pack(batch) -> list[PackedSample]:
    out = []
    for s in batch.samples:
        r, sc = s.rollout, s.scored
        out.append(PackedSample(r.rollout_id, s.group, float(sc.reward), float(s.weight), int(s.lag),
                                list(r.prompt_ids), list(r.completion_ids), list(r.logprobs), dict(r.sampling),
                                dict(r.sampling_mask), dict(r.quant), float(sc.success), float(sc.cost),
                                float(sc.lambda_)))
    return out


def sampling_config(d: dict) -> SamplingConfig:
    return SamplingConfig(temperature=float(d.get("temperature", 1.0)), top_p=float(d.get("top_p", 1.0)),
                          top_k=int(d.get("top_k", 0)))


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Learner:
    def __init__(self, model: Transformer, optimizer: torch.optim.Optimizer, loss_cfg: LossConfig,
                 adv_norm: str = "std", grad_clip: float = 0.0, replay: bool = True):
        self.model, self.opt, self.loss_cfg = model, optimizer, loss_cfg
        self.adv_norm, self.grad_clip, self.replay = adv_norm, grad_clip, replay

    def _logprobs(self, s: PackedSample):
        replay = None
        if self.replay:
            replay = Replay(mask=SamplingMask.from_wire(s.sampling_mask), sampling=sampling_config(s.sampling),
                            quant=QuantConfig.from_wire(s.quant))
        return sequence_logprobs(self.model, s.prompt_ids, s.completion_ids, replay=replay)

    def loss(self, samples: list[PackedSample], grad: bool = True) -> tuple[torch.Tensor, dict]:
        """This rank's share of the batch loss (summing over ranks gives the full loss)."""
        rank, ws = world()
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        groups = torch.tensor([s.group for s in samples], dtype=torch.long)
        adv = group_advantages(rewards, groups, self.adv_norm)
        live = [i for i, s in enumerate(samples) if s.weight > 0 and s.completion_ids]
        n_tokens = sum(len(samples[i].completion_ids) for i in live)
        mine = live[rank::ws]
        logps, behav, advs, wts, ents = [], [], [], [], []
        with torch.set_grad_enabled(grad):
            for i in mine:
                s = samples[i]
                res = self._logprobs(s)
                T = len(s.completion_ids)
                logps.append(res.logprobs)
                ents.append(res.entropy)
                behav.append(torch.tensor(s.logprobs, dtype=torch.float32))
                advs.append(adv[i].expand(T))
                wts.append(torch.full((T,), s.weight))
            if not mine:       # this rank has no tokens: a zero loss that still touches every param
                zero = sum(p.sum() * 0 for p in self.model.parameters())
                return zero, {"n_tokens": n_tokens, "adv": adv}
            logp, b, a, w, ent = (torch.cat(x) for x in (logps, behav, advs, wts, ents))
            loss, stats = pg_loss(logp.float(), b, a, w, n_tokens, self.loss_cfg, ent.float())
        stats.update(mismatch_metrics(logp.detach().float(), b))
        stats.update(n_tokens=n_tokens, adv=adv, entropy=float(ent.detach().float().mean()))
        return loss, stats

    def _all_reduce_grads(self) -> None:
        _, ws = world()
        if ws == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        off = 0
        for p in params:
            n = p.numel()
            p.grad = flat[off:off + n].view_as(p).clone()
            off += n

    def step(self, samples: list[PackedSample]) -> dict:
        t0 = time.perf_counter()
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        loss, stats = self.loss(samples, grad=True)
        loss.backward()
        self._all_reduce_grads()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or float("inf"))
        self.opt.step()
        full_loss = loss.detach().clone()
        if world()[1] > 1:
            dist.all_reduce(full_loss, op=dist.ReduceOp.SUM)
        adv = stats.pop("adv")
        stats.update(loss=float(full_loss), grad_norm=float(gnorm), step_s=time.perf_counter() - t0,
                     adv_mean=float(adv.mean()), adv_std=float(adv.std()) if adv.numel() > 1 else 0.0,
                     adv_abs_max=float(adv.abs().max()) if adv.numel() else 0.0)
        return stats

    def published_state(self) -> dict[str, torch.Tensor]:
        return inference_state(self.model, dtype=torch.bfloat16)
