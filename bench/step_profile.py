"""The trainer's own RL step on a real model, split by phase and set against this machine's fp32
matmul rate (`python -m bench.realmodel --json` reports it as `step_profile`).

    profile_step(folder, samples, steps, delta_context) -> {
      step_flops           FLOPs one Learner.step executes (torch.utils.flop_counter: forward and
                           backward matmuls and attention, recomputed chunks included)
      step_s               median seconds of Learner.step (forward + replay + backward + optimizer)
      matmul_flop_s        fp32 torch.matmul FLOP/s at the step's shapes (each Linear's [tokens, in] @
                           [in, out], the logit projection over completion tokens), weighted by use
      step_flops_fraction  (step_flops / step_s) / matmul_flop_s
      phases_s             medians of disjoint phases: forward (the loss forward less the replay's
                           share), replay (a no-grad forward with the shipped kept sets minus one
                           without), backward, optimizer, cast (fp32 -> the
                           published bf16), encode (delta_codec, delta_context as the trainer would),
                           checkpoint (snapshot + atomic save), publish (the delta's bytes: the
                           broker write is not part of it)
      phase_frac           each phase over their sum }

Timers are time.perf_counter around each phase, no device sync (this is for the CPU). The ratio
means something only alone on the box: the matmul bench and the step share the cores.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

import delta_codec
import policy
from trainer import checkpoint
from trainer.config import TrainerConfig
from trainer.factory import build_learner, build_model, build_optimizer
from trainer.learner import Learner, PackedSample

PHASES = ("forward", "replay", "backward", "optimizer", "cast", "encode", "checkpoint", "publish")


def packed(prompts, gens, rewards, group: int, sampling: dict) -> list[PackedSample]:
    """The step's samples from the engine's generations (their logprobs and kept sets), as the
    trainer receives them."""
    return [
        PackedSample(
            f"r{i}",
            i // group,
            float(r),
            1.0,
            0,
            list(p),
            list(g.completion_ids),
            list(g.logprobs),
            dict(sampling),
            dict(g.sampling_mask),
            {},
        )
        for i, (p, g, r) in enumerate(zip(prompts, gens, rewards))
        if g.completion_ids
    ]


def matmul_flop_s(model, tokens: int, completion_tokens: int, reps: int = 3) -> float:
    """fp32 FLOP/s of torch.matmul at the step's shapes, each weighted by how often the step uses it."""
    shapes: Counter = Counter()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[(tokens, m.in_features, m.out_features)] += 1
    vocab, d = model.cfg.vocab_size, model.cfg.d_model
    shapes[(max(completion_tokens, 1), d, vocab)] += 1  # the logit projection
    flops, secs = 0.0, 0.0
    for (m, k, n), uses in shapes.items():
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.matmul(a, b)  # warm (allocator, kernel choice)
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        dt = (time.perf_counter() - t) / reps
        flops += uses * 2.0 * m * k * n
        secs += uses * dt
    return flops / max(secs, 1e-12)


def replay_s(learner: Learner, samples: list[PackedSample]) -> float:
    """What replaying the shipped kept sets adds to a forward (no grad): with minus without."""
    prompts, comps = [s.prompt_ids for s in samples], [s.completion_ids for s in samples]
    cfgs = [policy.SamplingConfig.from_dict(s.sampling) for s in samples]
    masks = [policy.SamplingMask.from_wire(s.sampling_mask) if s.sampling_mask else None for s in samples]
    out = []
    with torch.no_grad():
        for replay in (True, False):
            t = time.perf_counter()
            policy.sequence_logprobs(
                learner.model,
                prompts,
                comps,
                cfgs,
                masks if replay else None,
                replay_mask=replay,
                chunk_tokens=learner.logit_chunk_tokens,
            )
            out.append(time.perf_counter() - t)
    return max(0.0, out[0] - out[1])


def profile_step(
    folder: Path,
    samples: list[PackedSample],
    steps: int = 3,
    delta_context: bool | str = "auto",
    lr: float = 1e-5,
    micro_batch: int = 32,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="asyncrl-stepprof-") as tmp:
        cfg = TrainerConfig(
            trainer_id="step-profile",
            policy={"init_checkpoint": str(folder), "device": "cpu"},
            optim={"lr": lr},
            loss={"micro_batch": micro_batch},
            publish={"delta_context": delta_context},
            checkpoint={"dir": tmp},
        )
        model, mcfg = build_model(cfg)
        learner = build_learner(model, build_optimizer(model, cfg), cfg)
        with FlopCounterMode(display=False) as fc:  # one counted step (not timed)
            learner.step(samples)
        step_flops = float(fc.get_total_flops())
        prev = learner.publication.published_state()
        rows = []
        for v in range(1, steps + 1):
            st = learner.step(samples)
            ph = {"forward": st["forward_s"], "backward": st["backward_s"], "optimizer": st["optimizer_s"]}
            t = time.perf_counter()
            new = learner.publication.published_state()
            ph["cast"] = time.perf_counter() - t
            t = time.perf_counter()
            delta = delta_codec.encode_delta(
                prev, new, from_version=v - 1, to_version=v, context=cfg.use_delta_context
            )
            ph["encode"] = time.perf_counter() - t
            t = time.perf_counter()
            state = checkpoint.TrainerState(
                version=v,
                epoch=1,
                **learner.checkpoint.payload(tmp, 1, v),
                consumed=[s.rollout_id for s in samples],
                digest=delta.new_digest,
                model_config=mcfg.to_dict(),
                step=v,
            )
            checkpoint.save(tmp, checkpoint.snapshot(state), keep=1)
            ph["checkpoint"] = time.perf_counter() - t
            t = time.perf_counter()
            delta.to_bytes()
            ph["publish"] = time.perf_counter() - t
            ph["replay"] = min(replay_s(learner, samples), ph["forward"])
            ph["forward"] -= ph["replay"]  # disjoint phases: the forward without the replay's share
            rows.append({**ph, "step_s": st["step_s"]})
            prev = new
        tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        comp = sum(len(s.completion_ids) for s in samples)
        mm = matmul_flop_s(model, tokens, comp)
    step_s = statistics.median(r["step_s"] for r in rows)
    phases = {k: statistics.median(r[k] for r in rows) for k in PHASES}
    total = sum(phases.values()) or 1.0
    return {
        "sequences": len(samples),
        "tokens": tokens,
        "completion_tokens": comp,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "delta_context": cfg.use_delta_context,
        "step_flops": step_flops,
        "step_s": step_s,
        "step_flop_s": step_flops / step_s,
        "matmul_flop_s": mm,
        "step_flops_fraction": step_flops / step_s / mm,
        "phases_s": phases,
        "phase_frac": {k: v / total for k, v in phases.items()},
    }
