"""One learner step: recompute logprobs under the workers' sampler (a group's completions packed
behind one copy of their prompt), PG loss (+ optional KL to the initial weights), gradients
reduced by torch FSDP2, AdamW with an LR schedule.

Micro-batches hold at most `micro_batch` sequences and `micro_batch_tokens` padded tokens (a
longer sequence goes alone); the vocabulary projection runs `logit_chunk_tokens` completion
tokens at a time (policy.sequence_logprobs), so neither the activations nor the fp32
[tokens, vocab] logits grow with the batch.

A step whose loss or gradient norm is not finite is skipped: no optimizer step, no LR schedule
update, so parameters and optimizer state stay bit-identical (every rank decides on the same
all-reduced numbers); `step` returns {"skipped": reason} and the leader parks the rollouts.

Data parallel over FSDP2 (trainer/fsdp.py): every rank holds the whole batch (rank 0 broadcasts
it) and works on prompt units u ≡ rank (mod world) (a unit: the samples packed behind one copy of
their prompt, policy/packing.py; one sample with share_prompts off). Each rank's loss is its
share of the global token sum over the global token count, so the sum of the ranks' gradients
is the 1-process gradient; FSDP2 reduce-scatters the mean, so each rank scales its loss by the
world size. FSDP2 runs
collectives inside every forward and backward, so every rank runs the same number of
micro-batches: a rank with fewer (or none) runs zero-weighted one-token passes. The step itself is
a collective (`Step`, trainer/commands.py): rank 0's `Learner.step` sends the batch, and every
rank runs the same step on it.

What else every rank holds lives with its own concern: `Learner.checkpoint` (the model and
optimizer part of a checkpoint, trainer/checkpoint_state.py), `Learner.publication` (the published
bf16 state and sharded parts, trainer/published.py); the warm start and the KL reference's anchor
run on the learner (trainer/warmstart.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from policy import (
    QuantConfig,
    SamplingConfig,
    SamplingMask,
    Transformer,
    mismatch_metrics,
    sequence_logprobs,
)
from policy.packing import prompt_units
from policy.reward import trained_rewards

from .buckets import length_buckets
from .checkpoint_state import CheckpointState
from .commands import Collective, collective, world
from .fsdp import full_tensor, is_sharded
from .loss import LossConfig, group_advantages, pg_loss
from .published import Publication
from .published_point import at_published_point
from .schedule import LRSchedule, apply_schedule


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
    loss_mask: list[int] | None = None  # multi-turn: 0 on observation tokens (None: all model tokens)
    # what the member scored before its price, and its overlong shaping (Scored.unpriced): the
    # penalty modes other than linear start from them (policy/reward.py)
    score: float = 0.0
    shaping: float = 0.0

    def model_mask(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.completion_ids)


def pack(batch) -> list[PackedSample]:
    out = []
    for s in batch.samples:
        r, sc = s.rollout, s.scored
        score, shaping = sc.unpriced()
        out.append(
            PackedSample(
                r.rollout_id,
                s.group,
                float(sc.reward),
                float(s.weight),
                int(s.lag),
                list(r.prompt_ids),
                list(r.completion_ids),
                list(r.logprobs),
                dict(r.sampling),
                dict(r.sampling_mask),
                dict(r.quant),
                float(sc.success),
                float(sc.cost),
                float(sc.lambda_),
                list(r.loss_mask) or None,
                float(score),
                float(shaping),
            )
        )
    return out


F32_MAX = float(torch.finfo(torch.float32).max)


def nonfinite_samples(samples: list[PackedSample]) -> dict[str, str]:
    """{rollout id: reason} of the live samples whose shipped numbers cannot enter a step (a
    non-finite behaviour logprob or reward): what a skipped step blames first."""
    out = {}
    for s in samples:
        if s.weight <= 0 or not s.completion_ids:
            continue
        lp = np.asarray(s.logprobs, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(lp))
        if bad.size:
            out[s.rollout_id] = f"non-finite logprobs at token {int(bad[0])} ({lp[bad[0]]})"
        elif not math.isfinite(s.reward) or abs(s.reward) > F32_MAX:  # the loss computes in fp32
            out[s.rollout_id] = f"non-finite reward in fp32 ({s.reward})"
    return out


# a pass's per-token tensors that the batch statistics use
_PASS_TENSORS = ("logp", "behav", "adv", "w", "ent", "model")


def _token_tensors(chunk: list[PackedSample], adv: torch.Tensor, dev):
    """One pass's per-token tensors [T] on dev: behaviour logprobs, the samples' advantages and
    weights repeated per token (weights 0 off the model tokens), the model-token mask."""
    lens = torch.tensor([len(s.completion_ids) for s in chunk])
    behav = torch.tensor([x for s in chunk for x in s.logprobs], dtype=torch.float32).to(dev)
    a = adv.repeat_interleave(lens).to(dev)
    w = torch.tensor([s.weight for s in chunk], dtype=torch.float32).repeat_interleave(lens).to(dev)
    model = torch.tensor([m for s in chunk for m in s.model_mask()], dtype=torch.bool).to(dev)
    w = w * model  # IS weights, entropy, KL and the PG term only on model tokens
    return behav, a, w, model


class Learner:
    def __init__(
        self,
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        loss_cfg: LossConfig,
        adv_norm: str = "mean",
        grad_clip: float = 0.0,
        replay: bool = True,
        micro_batch: int = 32,
        schedule: LRSchedule | None = None,
        kl_coef: float = 0.0,
        reference: Transformer | None = None,
        async_checkpoint: bool = False,
        micro_batch_tokens: int = 0,
        logit_chunk_tokens: int = 0,
        penalty: str = "linear",
        penalty_cap: float = 0.25,
        published_point: bool = True,
        delta_context: bool = False,
    ):
        self.model, self.opt = model, optimizer
        self.loss_cfg = dataclasses.replace(loss_cfg, kl_coef=kl_coef) if kl_coef else loss_cfg
        self.adv_norm, self.grad_clip, self.replay, self.micro_batch = (
            adv_norm,
            grad_clip,
            replay,
            micro_batch,
        )
        self.micro_batch_tokens, self.logit_chunk_tokens = micro_batch_tokens, logit_chunk_tokens
        self.penalty, self.penalty_cap = penalty, penalty_cap
        self.published_point = published_point  # forward/backward on the bf16 the workers hold
        self.schedule, self.kl_coef, self.reference = schedule, kl_coef, reference
        if kl_coef > 0 and reference is None:
            raise ValueError("kl_coef > 0 needs a frozen reference model")
        self.checkpoint = CheckpointState(model, optimizer, async_save=async_checkpoint)
        # delta_context: sharded parts code positions in the context of the base
        self.publication = Publication(model, delta_context=delta_context)

    def _units(self, samples: list[PackedSample], idx: list[int]) -> list[list[int]]:
        """Sample indices that run as one packed row (one prompt's completions behind one copy of
        it, policy/packing.py), or one each with share_prompts off."""
        if not self.loss_cfg.share_prompts:
            return [[i] for i in idx]
        units = prompt_units(
            [samples[i].prompt_ids for i in idx],
            [samples[i].completion_ids for i in idx],
            self.loss_cfg.packed_row_tokens,
        )
        return [[idx[k] for k in u] for u in units]

    def _runs(self, samples: list[PackedSample], idx: list[int]) -> list[tuple[dict, list[int]]]:
        """(quant, sample indices) of each micro-batch: shared quant config, similar lengths; a
        packed unit counts its packed tokens and stays whole (at most micro_batch sequences per
        pass where units allow)."""
        by_quant: dict[str, list[int]] = {}
        for i in idx:
            by_quant.setdefault(repr(sorted(samples[i].quant.items())), []).append(i)
        out = []
        for group in by_quant.values():
            units = self._units(samples, group)
            lens = [
                len(samples[u[0]].prompt_ids) + sum(len(samples[i].completion_ids) for i in u) for u in units
            ]
            widest = max(len(u) for u in units)
            runs = length_buckets(
                lens, max(1, self.micro_batch // widest), max_tokens=self.micro_batch_tokens
            )
            out += [(samples[group[0]].quant, [i for r in run for i in units[r]]) for run in runs]
        return out

    def _share(self, samples: list[PackedSample], live: list[int], rank: int, ws: int) -> list[int]:
        """This rank's samples: every ws-th unit (a packed unit is never split over ranks)."""
        if ws == 1:
            return live
        return [i for u in self._units(samples, live)[rank::ws] for i in u]

    def _run_logprobs(self, model, chunk: list[PackedSample], quant: dict):
        """Packed [T] logprobs and entropies of one micro-batch, replaying its kept sets and fp8
        sites (quant sites carry no weights: switched on the model for the call)."""
        keep = model.quant
        model.quant = QuantConfig.from_wire(quant) if self.replay else keep
        try:
            res = sequence_logprobs(
                model,
                [s.prompt_ids for s in chunk],
                [s.completion_ids for s in chunk],
                [SamplingConfig.from_dict(s.sampling) for s in chunk],
                [SamplingMask.from_wire(s.sampling_mask) if s.sampling_mask else None for s in chunk]
                if self.replay
                else None,
                replay_mask=self.replay,
                chunk_tokens=self.logit_chunk_tokens,
                share_prompts=self.loss_cfg.share_prompts,
                packed_row_tokens=self.loss_cfg.packed_row_tokens,
            )
        finally:
            model.quant = keep
        return (
            torch.cat([res.logprobs[k][res.valid[k]] for k in range(len(chunk))]),
            torch.cat([res.entropy[k][res.valid[k]] for k in range(len(chunk))]),
        )

    def _idle_pass(self, dev) -> torch.Tensor:
        """A one-token forward whose loss is zero: keeps this rank in step with FSDP2's collectives,
        in the order of a real pass (policy forward, then the reference's: swapped, the ranks'
        all-gathers no longer pair up and gloo aborts on a size mismatch)."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        part = self.model(ids).sum() * 0.0
        if self.loss_cfg.kl_coef > 0 and self.reference is not None:
            with torch.no_grad():
                self.reference(ids)
        return part

    def loss(
        self, samples: list[PackedSample], grad: bool = True, backward: bool = False
    ) -> tuple[torch.Tensor, dict]:
        """This rank's share of the batch loss (summing over ranks gives the full loss).
        backward=True: gradients are accumulated micro-batch by micro-batch (activations of one
        micro-batch alive at a time) and the returned loss is detached.

        Each pass divides by the live token count N0 (known before any forward); which tokens
        the IS correction rejects is known only after each forward, so once every pass is done
        the loss (and the accumulated gradients) are rescaled by N0 / kept, kept summed over
        all ranks: the result is the loss over the kept tokens only."""
        rank, ws = world()
        dev = next(self.model.parameters()).device
        live = [i for i, s in enumerate(samples) if s.weight > 0 and s.completion_ids]
        adv, on = self._advantages(samples, live)
        # only model tokens are trained on: observation tokens (loss mask 0) count nowhere
        n_tokens = sum(sum(samples[i].model_mask()) for i in live)
        runs, n_pass, scale = self._plan(samples, live, rank, ws)
        total = torch.zeros((), device=dev)
        sums = {"kept": 0.0, "kl_sum": 0.0, "kl_weight": 0.0}  # this rank's: summed over ranks at the end
        fwd_s, bwd_s = 0.0, 0.0  # phase timers (wall, no device sync: CPU-exact, GPU-queued)
        keep: list[tuple[torch.Tensor, ...]] = []  # each pass's _PASS_TENSORS, for the batch stats
        with torch.set_grad_enabled(grad or backward):
            for k in range(n_pass):
                if k >= len(runs):  # this rank's micro-batches are done: a zero pass keeps it in step
                    part = self._idle_pass(dev)
                    if backward:
                        part.backward()
                    else:
                        total = total + part
                    continue
                quant, run = runs[k]
                chunk = [samples[i] for i in run]
                t = time.perf_counter()
                part, st, tokens = self._micro_batch_loss(chunk, quant, adv[run], n_tokens, dev)
                fwd_s += time.perf_counter() - t
                sums = {key: v + st.get(key, 0.0) for key, v in sums.items()}
                if backward:
                    t = time.perf_counter()
                    (part * scale).backward()
                    part = part.detach()
                    bwd_s += time.perf_counter() - t
                total = total + part
                keep.append(tokens)
        total, kept, kl_sum, kl_weight = self._rescale_to_kept(total, n_tokens, sums, backward, dev, ws)
        stats = dict(n_tokens=n_tokens, kept_tokens=kept, adv=adv[on], forward_s=fwd_s, backward_s=bwd_s)
        stats.update(self._batch_stats(keep, n_tokens, kl_sum, kl_weight))
        return total, stats

    def _advantages(self, samples: list[PackedSample], live: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(group advantages [N], live mask [N]) of the rewards trained on: each member's price
        (linear), or its group's under the penalty mode (policy/reward.py, where the group is known)."""
        groups = torch.tensor([s.group for s in samples], dtype=torch.long)
        on = torch.zeros(len(samples), dtype=torch.bool)
        on[live] = True
        col = lambda k: np.array([getattr(s, k) for s in samples], dtype=np.float64)  # noqa: E731
        rewards = torch.from_numpy(
            trained_rewards(
                self.penalty,
                col("reward"),
                col("score"),
                col("success"),
                col("cost"),
                col("lambda_"),
                col("shaping"),
                groups.numpy(),
                self.penalty_cap,
                live=on.numpy(),
            )
        )
        if self.penalty == "linear":  # the price enters the baseline in fp32, as it always has
            rewards = rewards.float()
        # a dropped (stale) sample is out of its group's baseline as well as out of the loss
        return group_advantages(rewards, groups, self.adv_norm, live=on), on

    def _plan(self, samples: list[PackedSample], live: list[int], rank: int, ws: int):
        """(this rank's micro-batches, passes every rank makes, the loss's scale for FSDP2's mean)."""
        runs = self._runs(samples, self._share(samples, live, rank, ws))
        # every rank computes every rank's plan: the longest decides how many passes all make
        n_pass = (
            max(len(self._runs(samples, self._share(samples, live, r, ws))) for r in range(ws))
            if is_sharded(self.model)
            else len(runs)
        )
        scale = float(ws) if is_sharded(self.model) else 1.0
        return runs, n_pass, scale

    def _micro_batch_loss(
        self, chunk: list[PackedSample], quant: dict, adv: torch.Tensor, n_tokens: int, dev
    ):
        """One pass: (loss part, pg_loss stats, its per-token tensors for the batch stats: _PASS_TENSORS)."""
        logp, ent = self._run_logprobs(self.model, chunk, quant)
        behav, a, w, model = _token_tensors(chunk, adv, dev)
        ref = None
        if self.loss_cfg.kl_coef > 0:
            with torch.no_grad():
                ref = self._run_logprobs(self.reference, chunk, quant)[0].float()
        part, st = pg_loss(logp.float(), behav, a, w, n_tokens, self.loss_cfg, ent.float(), ref=ref)
        return part, st, (logp.detach().float(), behav, a, w, ent.detach().float(), model)

    def _rescale_to_kept(self, total: torch.Tensor, n_tokens: int, sums: dict, backward: bool, dev, ws: int):
        """The loss (and the accumulated gradients) times N0 / kept, kept summed over all ranks;
        returns (loss, kept, kl_sum, kl_weight), the sums those of the whole batch."""
        kept, kl_sum, kl_weight = sums["kept"], sums["kl_sum"], sums["kl_weight"]
        if ws > 1:  # the same factor on every rank: the kept count of the whole batch
            total_sums = torch.tensor([kept, kl_sum, kl_weight], dtype=torch.float64, device=dev)
            dist.all_reduce(total_sums, op=dist.ReduceOp.SUM)
            kept, kl_sum, kl_weight = (float(x) for x in total_sums)
        factor = n_tokens / kept if kept > 0 else 1.0
        if factor != 1.0:
            total = total * factor
            if backward:
                with torch.no_grad():
                    for p in self.model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(factor)
        return total, kept, kl_sum, kl_weight

    def _batch_stats(
        self, keep: list[tuple[torch.Tensor, ...]], n_tokens: int, kl_sum: float, kl_weight: float
    ) -> dict:
        """IS, mismatch, entropy and KL statistics of this rank's share, from its kept per-token tensors."""
        stats: dict = {}
        if not keep:
            return stats
        cat = {k: torch.cat(v) for k, v in zip(_PASS_TENSORS, zip(*keep))}
        with torch.no_grad():
            _, st = pg_loss(cat["logp"], cat["behav"], cat["adv"], cat["w"], n_tokens, self.loss_cfg)
        stats.update({k: st[k] for k in ("is_weight_mean", "frac_truncated", "frac_masked")})
        if bool(cat["model"].any()):
            mm = mismatch_metrics(
                cat["behav"][cat["model"]], cat["logp"][cat["model"]], C=self.loss_cfg.is_clip
            )
            stats.update({k: mm[k] for k in ("k3_mean", "ratio_mean", "ratio_p99_abs_log", "frac_outside_C")})
            stats["entropy"] = float(cat["ent"][cat["model"]].mean())
        if self.loss_cfg.kl_coef > 0:
            stats["kl_ref"] = kl_sum / kl_weight if kl_weight > 0 else 0.0
        return stats

    def step(self, samples: list[PackedSample]) -> dict:
        """One optimizer step on `samples` (the whole batch), on every rank: a collective."""
        return collective(Step(samples), self)

    def local_step(self, samples: list[PackedSample]) -> dict:
        """This rank's part of `step` (what the Step collective runs on each rank); call `step`."""
        t0 = time.perf_counter()
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        with at_published_point(self.model, on=self.published_point):
            loss, stats = self.loss(samples, grad=True, backward=True)
        params = [p for p in self.model.parameters() if p.grad is not None]
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip or float("inf"))
        gnorm = full_tensor(gnorm)
        full_loss = loss.detach().clone()
        if world()[1] > 1:
            dist.all_reduce(full_loss, op=dist.ReduceOp.SUM)
        # every rank holds the same full loss and norm here, so every rank takes the same branch
        skip = None if torch.isfinite(full_loss) else "nonfinite_loss"
        skip = skip or (None if torch.isfinite(gnorm) else "nonfinite_grad")
        adv = stats.pop("adv")
        if skip:
            self.opt.zero_grad(set_to_none=True)  # the poisoned gradients go; nothing else changed
            return {
                "skipped": skip,
                "loss": float(full_loss),
                "grad_norm": float(gnorm),
                "step_s": time.perf_counter() - t0,
            }
        lr = apply_schedule(self.opt, self.schedule)
        t = time.perf_counter()
        self.opt.step()
        stats["optimizer_s"] = time.perf_counter() - t
        stats.update(
            loss=float(full_loss),
            grad_norm=float(gnorm),
            lr=lr,
            step_s=time.perf_counter() - t0,
            adv_mean=float(adv.mean()) if adv.numel() else 0.0,
            adv_std=float(adv.std()) if adv.numel() > 1 else 0.0,
            adv_abs_max=float(adv.abs().max()) if adv.numel() else 0.0,
        )
        return stats


@dataclass(frozen=True)
class Step(Collective[dict], on=Learner):
    """Every rank steps on the whole batch (each replays its own share of it): see the module doc."""

    samples: list[PackedSample]

    def run(self, learner: Learner) -> dict:
        return learner.local_step(self.samples)
