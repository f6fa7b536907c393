"""Builds what a trainer process trains: model (fresh or from an HF checkpoint), optimizer, learner."""
from __future__ import annotations

import os

import torch

from policy import ModelConfig, Transformer, load_tokenizer

from .config import TrainerConfig
from .learner import Learner
from .loss import LossConfig


def build_model(cfg: TrainerConfig) -> tuple[Transformer, ModelConfig]:
    torch.manual_seed(cfg.seed)          # every rank builds identical initial weights
    if cfg.init_checkpoint:
        from policy import load_hf_checkpoint
        mcfg, model = load_hf_checkpoint(cfg.init_checkpoint, dtype=torch.float32, device=device(cfg))
        return model, mcfg
    # the vocabulary defaults to the tokenizer's, so the policy cannot sample an undecodable id
    tok_vocab = load_tokenizer(cfg.tokenizer).vocab_size
    over = {k: v for k, v in cfg.model.items() if k != "preset"}
    vocab = over.pop("vocab_size", tok_vocab)
    if vocab < tok_vocab:
        raise ValueError(f"model vocab_size {vocab} is smaller than the tokenizer's {tok_vocab}")
    mcfg = ModelConfig.preset(cfg.model.get("preset", "tiny"), vocab_size=vocab, **over)
    return Transformer(mcfg).float().to(device(cfg)), mcfg


def device(cfg: TrainerConfig) -> torch.device:
    if cfg.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device(cfg.device)


def build_optimizer(model, cfg: TrainerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def build_learner(model, opt, cfg: TrainerConfig) -> Learner:
    lc = LossConfig(is_mode=cfg.is_mode, is_clip=cfg.is_clip, ppo_clip=cfg.ppo_clip, entropy_coef=cfg.entropy_coef)
    return Learner(model, opt, lc, adv_norm=cfg.adv_norm, grad_clip=cfg.grad_clip, replay=cfg.replay,
                   micro_batch=cfg.micro_batch)
