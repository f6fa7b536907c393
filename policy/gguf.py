"""GGUF (llama.cpp) Llama checkpoints -> a standard Hugging Face folder: config.json, bf16
safetensors, tokenizer.json (byte-level BPE from the GGUF vocab and merges), tokenizer_config.json
with the chat template. The `gguf` package parses the file and dequantises its tensors
(gguf.quants); the rotary un-permutation and the tokenizer/config construction are ours."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

_TOKEN_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
_TOKEN_USER = 4
# GGUF tensor name (per block) -> HF name
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp "pre" tokenizer names whose split is: every digit alone, then the GPT-2 regex
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rows of q/k ([h, 2, d/2] -> [h, d/2, 2]) for
    its GPT-J style rotary; HF's rotate_half wants the halves back: [h, d/2, 2] -> [h, 2, d/2]."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def _f32(v) -> float:
    """A GGUF float32 field as the short decimal it was written from (9.99e-06 -> 1e-05)."""
    return float(str(np.float32(v)))  # numpy prints the shortest round-tripping decimal


def _fields(reader) -> dict:
    out = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        out[k] = f.contents()
    return out


def read_gguf(path):
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ImportError("reading GGUF files needs the `gguf` package (pip install gguf)") from e
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def hf_config(meta: dict) -> dict:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} not supported (only 'llama')")
    a = "llama."
    H, D = int(meta[a + "attention.head_count"]), int(meta[a + "embedding_length"])
    head_dim = int(meta.get(a + "rope.dimension_count", D // H))
    if a + "rope.scaling.type" in meta and meta[a + "rope.scaling.type"] not in ("none",):
        raise ValueError(f"GGUF rope scaling {meta[a + 'rope.scaling.type']!r} not supported")
    vocab = int(meta.get(a + "vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": D,
        "intermediate_size": int(meta[a + "feed_forward_length"]),
        "num_hidden_layers": int(meta[a + "block_count"]),
        "num_attention_heads": H,
        "num_key_value_heads": int(meta.get(a + "attention.head_count_kv", H)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.get(a + "context_length", 2048)),
        "rope_theta": _f32(meta.get(a + "rope.freq_base", 10000.0)),
        "rms_norm_eps": _f32(meta[a + "attention.layer_norm_rms_epsilon"]),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }
    for ours, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[ours] = int(meta[f"tokenizer.ggml.{key}"])
    return cfg


def hf_tensors(reader, cfg: dict, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every GGUF tensor dequantised and renamed to HF Llama names (q/k un-permuted)."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists ne0 (columns) first
        try:
            w = dequantize(t.data, t.tensor_type).reshape(shape)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {t.name!r}: {e}") from None
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
            if parts[2] == "attn_q":
                w = unpermute_rotary(w, cfg["num_attention_heads"])
            elif parts[2] == "attn_k":
                w = unpermute_rotary(w, cfg["num_key_value_heads"])
        elif t.name == "rope_freqs.weight":
            raise ValueError(
                "GGUF carries rope_freqs (Llama 3 rope scaling): not supported by this converter"
            )
        else:
            raise ValueError(f"GGUF tensor {t.name!r} has no HF Llama counterpart")
        # an F32 tensor comes back as a view of the read-only file map: torch wants writable memory
        out[name] = torch.from_numpy(np.require(w, requirements=["C", "W"])).to(dtype)
    return out


def hf_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` for a GGUF 'gpt2' (byte-level BPE) vocab: same ids, same merges,
    control/user-defined tokens as added tokens so chat markup encodes to one id each."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} not supported (only byte-level BPE 'gpt2')")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocab has duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre", "default")
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre in _DIGIT_SPLIT_PRE
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(t, special=ty == _TOKEN_CONTROL, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_TOKEN_CONTROL, _TOKEN_USER)
    ]
    tok.add_tokens(special)
    return tok


def tokenizer_config(meta: dict, cfg: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]

    def name(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None else None

    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg["max_position_embeddings"],
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "pad_token": name("padding_token_id"),
        "unk_token": name("unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in meta:
        out["chat_template"] = meta["tokenizer.chat_template"]
    return {k: v for k, v in out.items() if v is not None}


def convert_gguf(src, dst, dtype=torch.bfloat16) -> Path:
    """Write the HF folder `dst` for the GGUF file `src`; the folder appears whole or not at all."""
    reader = read_gguf(src)
    meta = _fields(reader)
    cfg = hf_config(meta)
    tensors = hf_tensors(reader, cfg, dtype)
    cfg["tie_word_embeddings"] = "lm_head.weight" not in tensors
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    if vocab != cfg["vocab_size"]:
        raise ValueError(f"GGUF vocab_size {cfg['vocab_size']} but token_embd has {vocab} rows")
    tok = hf_tokenizer(meta)
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta, cfg), indent=2))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
