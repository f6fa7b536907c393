"""One learner step: recompute logprobs under the workers' sampler, PG loss, all-reduce, AdamW.

Data parallel: every rank holds the whole batch (rank 0 broadcasts it) and works on samples
i ≡ rank (mod world). Each rank's loss is its share of the global token sum over the global
token count, so summing gradients across ranks gives exactly the 1-process gradient. Gradients
are summed with one flat all-reduce, which is what DDP's reducer does; done by hand so that the
normalisation is global (DDP would average per-rank means) and a rank that drew no tokens in a
small batch still takes part in the collective.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from policy import (QuantConfig, SamplingConfig, SamplingMask, Transformer, inference_state, mismatch_metrics,
                    sequence_logprobs)

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
    loss_mask: list[int] | None = None     # multi-turn: 0 on observation tokens (None: all model tokens)

    def model_mask(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.completion_ids)


def pack(batch) -> list[PackedSample]:
    out = []
    for s in batch.samples:
        r, sc = s.rollout, s.scored
        out.append(PackedSample(r.rollout_id, s.group, float(sc.reward), float(s.weight), int(s.lag),
                                list(r.prompt_ids), list(r.completion_ids), list(r.logprobs), dict(r.sampling),
                                dict(r.sampling_mask), dict(r.quant), float(sc.success), float(sc.cost),
                                float(sc.lambda_), list(r.loss_mask) or None))
    return out


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def length_buckets(lengths: list[int], max_batch: int, overhead_tokens: int = 64) -> list[list[int]]:
    """Split sequences into padded micro-batches of similar length (indices into `lengths`).

    A padded forward costs about batch x longest tokens, plus a fixed per-call cost; with a
    long-tailed length distribution one long answer would pad every short one to its length.
    Sorted by length, the cheapest split into contiguous runs is a small dynamic programme:
    best[j] = min_i best[i] + (j - i) * len[j-1] + overhead, with runs of at most max_batch."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    srt = [lengths[i] for i in order]
    n, inf = len(srt), float("inf")
    best, cut = [0.0] + [inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(max(0, j - max_batch), j):
            c = best[i] + (j - i) * srt[j - 1] + overhead_tokens
            if c < best[j]:
                best[j], cut[j] = c, i
    runs, j = [], n
    while j > 0:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]


class Learner:
    def __init__(self, model: Transformer, optimizer: torch.optim.Optimizer, loss_cfg: LossConfig,
                 adv_norm: str = "std", grad_clip: float = 0.0, replay: bool = True, micro_batch: int = 32):
        self.model, self.opt, self.loss_cfg = model, optimizer, loss_cfg
        self.adv_norm, self.grad_clip, self.replay, self.micro_batch = adv_norm, grad_clip, replay, micro_batch

    def _logprobs(self, samples: list[PackedSample]):
        """Packed [T] logprobs and entropies, replaying each rollout's kept sets and fp8 sites.

        Sequences that share a quant config run as padded micro-batches of similar length; the
        model's quant sites are switched to the rollout's (they carry no weights)."""
        logps, ents = [None] * len(samples), [None] * len(samples)
        by_quant: dict[str, list[int]] = {}
        for i, s in enumerate(samples):
            by_quant.setdefault(repr(sorted(s.quant.items())), []).append(i)
        keep_quant = self.model.quant
        try:
            for idx in by_quant.values():
                self.model.quant = QuantConfig.from_wire(samples[idx[0]].quant) if self.replay else keep_quant
                lens = [len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in idx]
                for run in length_buckets(lens, self.micro_batch):
                    run = [idx[r] for r in run]
                    chunk = [samples[i] for i in run]
                    res = sequence_logprobs(
                        self.model, [s.prompt_ids for s in chunk], [s.completion_ids for s in chunk],
                        [SamplingConfig.from_dict(s.sampling) for s in chunk],
                        [SamplingMask.from_wire(s.sampling_mask) if s.sampling_mask else None for s in chunk]
                        if self.replay else None,
                        replay_mask=self.replay)
                    for k, i in enumerate(run):
                        logps[i], ents[i] = res.logprobs[k][res.valid[k]], res.entropy[k][res.valid[k]]
        finally:
            self.model.quant = keep_quant
        return torch.cat(logps), torch.cat(ents)

    def loss(self, samples: list[PackedSample], grad: bool = True) -> tuple[torch.Tensor, dict]:
        """This rank's share of the batch loss (summing over ranks gives the full loss)."""
        rank, ws = world()
        dev = next(self.model.parameters()).device
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        groups = torch.tensor([s.group for s in samples], dtype=torch.long)
        adv = group_advantages(rewards, groups, self.adv_norm)
        live = [i for i, s in enumerate(samples) if s.weight > 0 and s.completion_ids]
        # only model tokens are trained on: observation tokens (loss mask 0) count nowhere
        n_tokens = sum(sum(samples[i].model_mask()) for i in live)
        mine = live[rank::ws]
        with torch.set_grad_enabled(grad):
            if not mine:       # this rank has no tokens: a zero loss that still touches every param
                zero = sum(p.sum() * 0 for p in self.model.parameters())
                return zero, {"n_tokens": n_tokens, "adv": adv}
            logp, ent = self._logprobs([samples[i] for i in mine])
            lens = torch.tensor([len(samples[i].completion_ids) for i in mine])
            behav = torch.tensor([x for i in mine for x in samples[i].logprobs], dtype=torch.float32).to(dev)
            a = adv[mine].repeat_interleave(lens).to(dev)
            w = torch.tensor([samples[i].weight for i in mine], dtype=torch.float32).repeat_interleave(lens).to(dev)
            model = torch.tensor([m for i in mine for m in samples[i].model_mask()], dtype=torch.bool).to(dev)
            w = w * model                 # IS weights, entropy and the PG term only on model tokens
            loss, stats = pg_loss(logp.float(), behav, a, w, n_tokens, self.loss_cfg, ent.float())
        mm = mismatch_metrics(behav[model], logp.detach().float()[model], C=self.loss_cfg.is_clip)
        stats.update({k: mm[k] for k in ("k3_mean", "ratio_mean", "ratio_p99_abs_log", "frac_outside_C")})
        stats.update(n_tokens=n_tokens, adv=adv, entropy=float(ent.detach().float()[model].mean()))
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
        """The bf16 bits workers will hold (on the CPU: the codec and the bus work there)."""
        return {k: v.cpu() for k, v in inference_state(self.model, dtype=torch.bfloat16).items()}
