"""policy: the numerics trainer and rollout workers share bit for bit (model, tokenizer,
sampling transform, fp8 fake-quant, logprob recomputation, mismatch metrics)."""

from .config import QUANT_SITES, ModelConfig, QuantConfig
from .generate import GenOut, generate
from .hf import hf_name_map, load_hf_checkpoint, save_hf_checkpoint
from .logprobs import (
    LOG_RATIO_CLAMP,
    LogprobResult,
    clamp_log_ratio,
    masked_is_weight,
    mismatch_metrics,
    sequence_logprobs,
    truncated_is_weight,
)
from .model import KVCache, Transformer, inference_state
from .quant import fake_quant, fp8_round
from .sampling import FULL, SampleOut, SamplingConfig, SamplingMask, sample
from .tokenizer import CharTokenizer, HFTokenizer, load_hf_tokenizer, load_tokenizer

__all__ = [
    "ModelConfig",
    "QuantConfig",
    "QUANT_SITES",
    "fake_quant",
    "fp8_round",
    "Transformer",
    "KVCache",
    "inference_state",
    "CharTokenizer",
    "HFTokenizer",
    "load_hf_tokenizer",
    "load_tokenizer",
    "SamplingConfig",
    "SamplingMask",
    "SampleOut",
    "sample",
    "FULL",
    "LogprobResult",
    "sequence_logprobs",
    "mismatch_metrics",
    "truncated_is_weight",
    "masked_is_weight",
    "LOG_RATIO_CLAMP",
    "clamp_log_ratio",
    "GenOut",
    "generate",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "hf_name_map",
]
