"""Model and quantisation configs: config classes (kernel.config) that travel as dicts (wire/TOML)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import Field

from kernel.config import config_class


@config_class
class ModelConfig:
    vocab_size: Annotated[int, Field(gt=0)] = 128
    d_model: Annotated[int, Field(gt=0)] = 128
    n_layers: Annotated[int, Field(gt=0)] = 4
    n_heads: int = 4
    n_kv_heads: Annotated[int, Field(description="GQA: query heads share n_heads // n_kv_heads groups")] = 2
    head_dim: Annotated[int, Field(description="0 = d_model // n_heads")] = 0
    d_ff: Annotated[int, Field(gt=0, description="SwiGLU hidden size")] = 384
    attn: Literal["gqa", "mla"] = "gqa"
    max_seq_len: Annotated[int, Field(gt=0)] = 2048
    rope_theta: float = 10000.0
    rope_scaling: Annotated[
        dict | None,
        Field(
            description='None = plain RoPE; {"rope_type": "linear", "factor": f} or Llama 3\'s {"rope_type": '
            '"llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}'
        ),
    ] = None
    norm_eps: float = 1e-6
    qkv_bias: Annotated[bool, Field(description="Qwen2 has biases on q/k/v")] = False
    tie_embeddings: bool = False
    # MLA (DeepSeek-V2 style): KV compressed to a latent, plus a decoupled RoPE part shared across heads
    kv_lora_rank: int = 64
    q_lora_rank: Annotated[int, Field(description="0 = full-rank query projection")] = 0
    qk_nope_dim: int = 32
    qk_rope_dim: int = 16
    v_head_dim: int = 32

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.d_model // self.n_heads
        problems = []
        if self.n_heads <= 0 or self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            problems.append(
                f"n_heads {self.n_heads} must be a positive multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2 or self.qk_rope_dim % 2:
            problems.append("RoPE dims (head_dim, qk_rope_dim) must be even")
        problems += rope_scaling_problems(self.rope_scaling)
        if problems:
            raise ValueError("bad ModelConfig: " + "; ".join(problems))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {sorted(unknown)}")
        return cls(**d)

    # presets: parameter counts are for the transformer body plus embeddings at the given vocab
    @classmethod
    def tiny(cls, vocab_size: int = 128, **kw) -> ModelConfig:  # ~1 M
        return cls(
            **{
                **dict(
                    vocab_size=vocab_size,
                    d_model=128,
                    n_layers=4,
                    n_heads=4,
                    n_kv_heads=2,
                    d_ff=384,
                    kv_lora_rank=64,
                    qk_nope_dim=32,
                    qk_rope_dim=16,
                    v_head_dim=32,
                ),
                **kw,
            }
        )

    @classmethod
    def small(cls, vocab_size: int = 128, **kw) -> ModelConfig:  # ~10 M
        return cls(
            **{
                **dict(
                    vocab_size=vocab_size,
                    d_model=384,
                    n_layers=6,
                    n_heads=6,
                    n_kv_heads=2,
                    d_ff=1024,
                    kv_lora_rank=128,
                    qk_nope_dim=64,
                    qk_rope_dim=32,
                    v_head_dim=64,
                ),
                **kw,
            }
        )

    @classmethod
    def base50m(cls, vocab_size: int = 128, **kw) -> ModelConfig:  # ~50 M
        return cls(
            **{
                **dict(
                    vocab_size=vocab_size,
                    d_model=640,
                    n_layers=11,
                    n_heads=10,
                    n_kv_heads=5,
                    d_ff=1728,
                    kv_lora_rank=256,
                    qk_nope_dim=64,
                    qk_rope_dim=32,
                    v_head_dim=64,
                ),
                **kw,
            }
        )

    @classmethod
    def base100m(cls, vocab_size: int = 128, **kw) -> ModelConfig:  # ~100 M
        return cls(
            **{
                **dict(
                    vocab_size=vocab_size,
                    d_model=768,
                    n_layers=13,
                    n_heads=12,
                    n_kv_heads=4,
                    d_ff=2560,
                    kv_lora_rank=256,
                    qk_nope_dim=64,
                    qk_rope_dim=32,
                    v_head_dim=64,
                ),
                **kw,
            }
        )

    @classmethod
    def preset(cls, name: str, vocab_size: int = 128, **kw) -> ModelConfig:
        presets = {"tiny": cls.tiny, "small": cls.small, "base50m": cls.base50m, "base100m": cls.base100m}
        if name not in presets:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(presets)}")
        return presets[name](vocab_size=vocab_size, **kw)


ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_scaling_problems(s) -> list[str]:
    if s is None:
        return []
    if not isinstance(s, dict):
        return [f"rope_scaling must be a dict or None, got {type(s).__name__}"]
    kind = s.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        return [f"rope_scaling rope_type {kind!r} not supported; supported: {sorted(ROPE_SCALING_KEYS)}"]
    need = ROPE_SCALING_KEYS[kind]
    missing = [k for k in need if k not in s]
    extra = sorted(set(s) - set(need) - {"rope_type"})
    out = [f"rope_scaling {kind} lacks {missing}"] if missing else []
    out += [f"rope_scaling {kind} has unknown keys {extra}"] if extra else []
    if not out and not all(isinstance(s[k], (int, float)) and s[k] > 0 for k in need):
        out.append(f"rope_scaling {kind} values must be positive numbers, got {s}")
    if not out and kind == "llama3" and s["high_freq_factor"] <= s["low_freq_factor"]:
        out.append("rope_scaling llama3 needs high_freq_factor > low_freq_factor")
    return out


QUANT_SITES = ("mla_rope_qk", "linear_act", "linear_weight")


@config_class(frozen=True)
class QuantConfig:
    """fp8 fake-quantisation sites. Scales are position-local (per token, or per token x block),
    so decoding one position at a time and teacher-forcing all positions quantise identically."""

    sites: tuple[Literal[QUANT_SITES], ...] = ()
    fmt: Annotated[Literal["e4m3"], Field(description="the fp8 format (only e4m3)")] = "e4m3"
    block: Annotated[
        int,
        Field(ge=0, description="0 = one scale per token (x head) row; >0 = blocks along the feature dim"),
    ] = 0

    def on(self, site: str) -> bool:
        return site in self.sites

    def to_wire(self) -> dict:
        return {"sites": list(self.sites), "fmt": self.fmt, "block": self.block}

    @classmethod
    def from_wire(cls, d: dict | None) -> QuantConfig:
        if not d:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"quant wire form must be a dict, got {type(d).__name__}")
        unknown = set(d) - {"sites", "fmt", "block"}
        if unknown:
            raise ValueError(f"unknown quant wire keys: {sorted(unknown)}")
        return cls(sites=tuple(d.get("sites", ())), fmt=d.get("fmt", "e4m3"), block=int(d.get("block", 0)))
