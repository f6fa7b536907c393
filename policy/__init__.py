"""policy: the numerics that processes share bit for bit: the model, tokenizer, sampling
transform, fp8 fake-quant, logprob recomputation and mismatch metrics (trainer and rollout
workers), and the reward (`policy/reward.py`: scorer and trainer).

Names load on first use (PEP 562): the scorer imports `policy.reward` without loading torch."""

from __future__ import annotations

import importlib

# public name -> the module of this package defining it
_HOME = {
    **dict.fromkeys(("ModelConfig", "QuantConfig", "QUANT_SITES"), "config"),
    **dict.fromkeys(("GenOut", "generate"), "generate"),
    **dict.fromkeys(("hf_name_map", "load_hf_checkpoint", "save_hf_checkpoint"), "hf"),
    **dict.fromkeys(
        (
            "LOG_RATIO_CLAMP",
            "LogprobResult",
            "clamp_log_ratio",
            "masked_is_weight",
            "mismatch_metrics",
            "sequence_logprobs",
            "truncated_is_weight",
        ),
        "logprobs",
    ),
    **dict.fromkeys(("KVCache", "Transformer", "inference_state"), "model"),
    **dict.fromkeys(("fake_quant", "fp8_round"), "quant"),
    **dict.fromkeys(("FULL", "SampleOut", "SamplingConfig", "SamplingMask", "sample"), "sampling"),
    **dict.fromkeys(("CharTokenizer", "HFTokenizer", "load_hf_tokenizer", "load_tokenizer"), "tokenizer"),
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
        globals()[name] = value  # once: later lookups do not come back here
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
