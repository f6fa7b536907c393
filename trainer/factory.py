"""Builds what a trainer process trains: model (fresh or from an HF checkpoint), optimizer, learner."""

from __future__ import annotations

import os

import torch

from policy import ModelConfig, Transformer, load_tokenizer

from .commands import world
from .config import TrainerConfig
from .fsdp import checkpoint_blocks, shard
from .learner import Learner
from .published_point import dither_master
from .schedule import LRSchedule


def build_model(cfg: TrainerConfig) -> tuple[Transformer, ModelConfig]:
    """The model every rank trains: whole with one process, sharded by FSDP2 in a group."""
    model, mcfg = initial_model(cfg)
    if cfg.loss.published_point and cfg.loss.master_dither:  # a resume then loads the dithered master
        dither_master(model, cfg.run.seed)
    if cfg.policy.activation_checkpointing:
        checkpoint_blocks(model)
    if world()[1] > 1:
        shard(model, device(cfg), mixed_precision=_mixed_precision(cfg))
    return model, mcfg


def build_reference(cfg: TrainerConfig) -> Transformer | None:
    """The frozen reference of the KL penalty (kl_coef > 0), sharded like the model: the initial
    weights here; a warm start moves it to the warm-started policy (trainer/warmstart.py anchor_reference)."""
    if cfg.loss.kl_coef <= 0:
        return None
    ref, _ = initial_model(cfg)
    ref.requires_grad_(False).eval()
    if world()[1] > 1:
        shard(ref, device(cfg), mixed_precision=_mixed_precision(cfg))
    return ref


def _mixed_precision(cfg: TrainerConfig) -> bool | None:
    return None if cfg.policy.mixed_precision == "auto" else cfg.policy.mixed_precision == "bf16"


def initial_model(cfg: TrainerConfig) -> tuple[Transformer, ModelConfig]:
    torch.manual_seed(cfg.run.seed)  # every rank builds identical initial weights
    if cfg.policy.init_checkpoint:
        from policy import load_hf_checkpoint

        mcfg, model = load_hf_checkpoint(cfg.policy.init_checkpoint, dtype=torch.float32, device=device(cfg))
        return model, mcfg
    # the vocabulary defaults to the tokenizer's, so the policy cannot sample an undecodable id
    tok_vocab = load_tokenizer(cfg.policy.tokenizer).vocab_size
    over = {k: v for k, v in cfg.policy.model.items() if k != "preset"}
    vocab = over.pop("vocab_size", tok_vocab)
    if vocab < tok_vocab:
        raise ValueError(f"model vocab_size {vocab} is smaller than the tokenizer's {tok_vocab}")
    mcfg = ModelConfig.preset(cfg.policy.model.get("preset", "tiny"), vocab_size=vocab, **over)
    return Transformer(mcfg).float().to(device(cfg)), mcfg


def device(cfg: TrainerConfig) -> torch.device:
    if cfg.policy.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device(cfg.policy.device)


def build_optimizer(model, cfg: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW on the fp32 master weights. One process: the fused kernel (one pass per tensor instead
    of foreach's several; the same update up to float rounding, several times faster on CPU for
    SmolLM2's 135 M parameters). A sharded group keeps the default for FSDP2's DTensor parameters."""
    fused = True if world()[1] == 1 else None
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        weight_decay=cfg.optim.weight_decay,
        fused=fused,
    )


def build_schedule(cfg: TrainerConfig) -> LRSchedule:
    decay = cfg.optim.decay_steps or max(cfg.run.max_steps - cfg.optim.warmup_steps, 0)
    return LRSchedule(cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.schedule, decay, cfg.optim.min_ratio)


def build_learner(model, opt, cfg: TrainerConfig, reference: Transformer | None = None) -> Learner:
    """`reference` (the frozen initial policy) is built here when kl_coef > 0 and none is given."""
    loss = cfg.loss  # [trainer.loss], taken whole by the loss
    # rows of fp32 logits per projection chunk: logit_chunk_mb of them whatever the vocabulary
    chunk = max(1, int(loss.logit_chunk_mb * 2**20 / (4 * model.cfg.vocab_size)))
    if reference is None and loss.kl_coef > 0:
        reference = build_reference(cfg)
    return Learner(
        model,
        opt,
        loss,
        adv_norm=loss.adv_norm,
        grad_clip=cfg.optim.grad_clip,
        replay=loss.replay,
        micro_batch=loss.micro_batch,
        schedule=build_schedule(cfg),
        kl_coef=loss.kl_coef,
        reference=reference,
        async_checkpoint=cfg.checkpoint.async_save,
        micro_batch_tokens=loss.micro_batch_tokens,
        logit_chunk_tokens=chunk,
        penalty=cfg.cost.penalty,
        penalty_cap=cfg.cost.penalty_cap,
        published_point=loss.published_point,
        delta_context=cfg.use_delta_context,
    )  # sharded parts are coded like the gathered delta
