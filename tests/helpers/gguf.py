"""GGUF test helpers: a tiny BPE tokenizer and Llama, written as a GGUF file the way llama.cpp
lays it out (skips the module without the gguf and transformers packages)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import quants as Q  # noqa: E402

from tests.helpers import bpe  # noqa: E402


def bpe_tokenizer():
    return bpe.bpe_tokenizer(
        ["def add(a, b):\n    return a + b", "hello world, 12 + 7 = 19", "print('ok')"] * 40, vocab_size=320
    )


def permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (written from its description)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(path, model, tok, quant: dict[str, str], arch="llama"):
    """A llama.cpp-style GGUF of an HF Llama; returns the HF state as the GGUF's values decode to."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(c.vocab_size))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([s for s, _ in vocab])
    w.add_token_types([3 if s.startswith("<|") else 1 for s, _ in vocab])
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(tok.token_to_id("<|im_start|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_chat_template(bpe.CHATML)
    decoded = {}
    for name, p in model.state_dict().items():
        a = p.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            g = "output.weight"
        else:
            _, _, i, *rest = name.split(".")
            g = f"blk.{i}.{GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"
        stored = a
        if g.endswith("attn_q.weight"):
            stored = permute_like_llama_cpp(a, c.num_attention_heads)
        elif g.endswith("attn_k.weight"):
            stored = permute_like_llama_cpp(a, c.num_key_value_heads)
        kind = quant.get(g.split(".")[-2], "F32")
        if kind == "F32":
            w.add_tensor(g, np.ascontiguousarray(stored))
            decoded[name] = torch.from_numpy(a.copy())
        else:
            t = getattr(gguf.GGMLQuantizationType, kind)
            raw = Q.quantize(np.ascontiguousarray(stored), t)
            w.add_tensor(g, raw, raw_shape=raw.shape, raw_dtype=t)
            back = Q.dequantize(raw, t).reshape(stored.shape)
            # the reference holds the dequantised values un-permuted, i.e. what the converter must produce
            n = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(g.split(".")[-2])
            if n:
                back = back.reshape(n, back.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)
            decoded[name] = torch.from_numpy(np.ascontiguousarray(back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


def tiny_llama(vocab: int, tie: bool, max_pos: int = 128):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    return transformers.LlamaForCausalLM(cfg).eval()
