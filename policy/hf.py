"""Llama / Qwen2 checkpoints in Hugging Face layout (config.json + *.safetensors, sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import ROPE_SCALING_KEYS, ModelConfig
from .model import Transformer

SUPPORTED = ("llama", "qwen2", "mistral")
# our module names -> HF names (after the "model." prefix); MLA names follow DeepSeek-V2
_RENAMES = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attn": "self_attn",
    "q_a_norm": "q_a_layernorm",
    "kv_a_proj": "kv_a_proj_with_mqa",
    "kv_a_norm": "kv_a_layernorm",
}


def hf_name_map(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> HF tensor name, for every parameter of a Transformer(cfg)."""
    names = _param_names(cfg)
    out = {}
    for n in names:
        if n == "tok_emb.weight":
            out[n] = "model.embed_tokens.weight"
        elif n == "lm_head.weight":
            out[n] = "lm_head.weight"
        else:
            out[n] = "model." + ".".join(_RENAMES.get(part, part) for part in n.split("."))
    return out


def _param_names(cfg: ModelConfig) -> list[str]:
    with torch.device("meta"):  # names only: no memory, no init cost
        return [n for n, _ in Transformer(cfg).named_parameters()]


def rope_scaling_from_hf(hf: dict) -> dict | None:
    """transformers < 5 writes `rope_scaling`, >= 5 `rope_parameters` (with rope_theta inside)."""
    raw = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(
            f"unsupported rope_scaling {raw} (supported rope_type: default, {', '.join(ROPE_SCALING_KEYS)})"
        )
    return {"rope_type": kind, **{k: raw[k] for k in ROPE_SCALING_KEYS[kind] if k in raw}}


def config_from_hf(hf: dict) -> ModelConfig:
    mt = hf.get("model_type")
    if mt not in SUPPORTED:
        raise ValueError(f"unsupported model_type {mt!r}; supported: {SUPPORTED}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r} (only silu)")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=true (biases on the MLP projections)")
    if mt != "qwen2" and hf.get("attention_bias"):
        raise ValueError(
            "unsupported attention_bias=true for Llama/Mistral (it adds an o_proj bias); "
            "only Qwen2's q/k/v biases are supported"
        )
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    H = hf["num_attention_heads"]
    max_len = hf.get("max_position_embeddings", 2048)
    # sliding-window attention is exact full attention up to the window: cap the length there
    window = hf.get("sliding_window") if mt == "mistral" or hf.get("use_sliding_window") else None
    if window:
        max_len = min(max_len, int(window))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=H,
        n_kv_heads=hf.get("num_key_value_heads") or H,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // H,
        d_ff=hf["intermediate_size"],
        attn="gqa",
        max_seq_len=max_len,
        rope_theta=float(theta),
        rope_scaling=rope_scaling_from_hf(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        qkv_bias=mt == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(folder / f)))
    return tensors


def load_hf_checkpoint(folder, dtype=torch.float32, device=None) -> tuple[ModelConfig, Transformer]:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    cfg = config_from_hf(json.loads(cfg_path.read_text()))
    tensors = _read_tensors(folder)
    names = hf_name_map(cfg)
    missing = [h for h in names.values() if h not in tensors]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    known = set(names.values()) | {"lm_head.weight"}  # tied checkpoints may still carry lm_head
    extra = [k for k in tensors if k not in known and "rotary_emb" not in k]
    if extra:
        raise ValueError(f"checkpoint {folder} has tensors we do not know: {extra[:3]}")
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device or "cpu").to(dtype)
    model.reset_rope()  # buffers were on meta: rebuild the RoPE tables for real
    model.load_inference_state({ours: tensors[h] for ours, h in names.items()})
    return cfg, model


def save_hf_checkpoint(model: Transformer, folder, dtype=None) -> Path:
    """Qwen2 layout when the model has q/k/v biases, Llama layout otherwise (HF Qwen2 always has them)."""
    cfg = model.cfg
    if cfg.attn != "gqa":
        raise ValueError("save_hf_checkpoint supports GQA (Llama/Qwen2) models only, not MLA")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    qwen = cfg.qkv_bias
    params = dict(model.named_parameters())
    tensors = {
        h: params[o].detach().to(dtype or params[o].dtype).contiguous().cpu()
        for o, h in hf_name_map(cfg).items()
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias,
        "torch_dtype": str(next(iter(tensors.values())).dtype).replace("torch.", ""),
    }
    if cfg.rope_scaling:
        hf["rope_scaling"] = dict(cfg.rope_scaling)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    return folder
