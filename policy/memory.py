"""How much device memory a trainer step needs, from the model config alone (nothing allocated).

    param_count(cfg)                                   the model's parameters
    memory_estimate(cfg, layers, tokens, published_point, shards=1, reference=False)
                                                       bytes per device of one step, by part
    fit_layers(cfg, free_bytes, tokens, published_point)   the most layers that fit one device

Bytes per parameter held through the step: fp32 master 4 + fp32 gradient 4 + AdamW's two fp32
moments 8 = 16, plus 4 for the published point's copy of the master (the trainer's default). Under
FSDP2 over `shards` devices each device holds 1/shards of those (and of the KL reference's fp32
weights, `reference`). On top, per device and not divided: the root (embedding, head) gathered in
bf16 through forward and backward, two blocks gathered and one block's bf16 gradients, every
block's checkpointed input (bf16 [tokens, hidden]), one block's activations live twice over while
it is recomputed and differentiated (34·hidden + 12·kv_dim + 8·mlp bytes per token, counted from
policy/model.py's saved tensors in bf16), and a few fp32 [chunk, vocab] logits. `tokens` is one
forward's tokens (the trainer's micro-batch). bench/gpu_llama8b.py measures a step against it;
`asyncrl config check` refuses a [layout] whose trainer share it does not fit.
"""

from __future__ import annotations

from .config import ModelConfig

# bytes per token of one block's saved activations in bf16: 34·hidden + 12·kv_dim + 8·mlp
ACT_HIDDEN, ACT_KV, ACT_MLP = 34, 12, 8
HEADROOM = 0.9  # the share of the free device memory the estimate may fill
LOGIT_CHUNK_MB = 64.0  # the trainer's default fp32 logits projected at a time ([trainer.loss] logit_chunk_mb)


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one GQA block (attention, MLP, two norms), from the config alone."""
    if cfg.attn != "gqa":
        raise ValueError(f"block_params counts GQA blocks only, not {cfg.attn!r}")
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = cfg.d_model * q + 2 * cfg.d_model * kv + q * cfg.d_model
    bias = q + 2 * kv if cfg.qkv_bias else 0
    return attn + bias + 3 * cfg.d_model * cfg.d_ff + 2 * cfg.d_model


def outer_params(cfg: ModelConfig) -> int:
    """Embedding, final norm and (untied) head."""
    emb = cfg.vocab_size * cfg.d_model
    return emb + cfg.d_model + (0 if cfg.tie_embeddings else emb)


def param_count(cfg: ModelConfig) -> int:
    """The model's parameter count, computed from the config (nothing allocated)."""
    return outer_params(cfg) + cfg.n_layers * block_params(cfg)


def logit_chunk_rows(cfg: ModelConfig, mb: float = LOGIT_CHUNK_MB) -> int:
    """The trainer's rows per vocabulary projection (trainer/factory.py build_learner)."""
    return max(1, int(mb * 2**20 / (4 * cfg.vocab_size)))


def memory_estimate(
    cfg: ModelConfig,
    layers: int,
    tokens: int,
    published_point: bool,
    *,
    shards: int = 1,
    reference: bool = False,
    logit_chunk_mb: float = LOGIT_CHUNK_MB,
) -> dict:
    """Device bytes of a step on `layers` of cfg's blocks, on each of `shards` FSDP2 devices."""
    per_param = 16 + (4 if published_point else 0)
    blk, outer = block_params(cfg), outer_params(cfg)
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    held = outer + layers * blk
    rows = logit_chunk_rows(cfg, logit_chunk_mb)
    parts = {
        "states": -(-per_param * held // shards),
        "gathered_bf16": 2 * outer + 3 * 2 * blk,
        "checkpointed_inputs": layers * tokens * cfg.d_model * 2,
        "block_activations": 2 * tokens * (ACT_HIDDEN * cfg.d_model + ACT_KV * kv_dim + ACT_MLP * cfg.d_ff),
        "logits": 6 * rows * cfg.vocab_size * 4 + 2 * tokens * cfg.d_model * 2,
    }
    if reference:  # the KL penalty's frozen fp32 copy, sharded like the model
        parts["reference"] = -(-4 * held // shards)
    return {"bytes_per_param": per_param, "parts": parts, "total": sum(parts.values())}


def fit_layers(cfg: ModelConfig, free_bytes: int, tokens: int, published_point: bool) -> int:
    """The most layers (up to cfg.n_layers) whose estimate fits HEADROOM of free_bytes; 0: none."""
    budget = HEADROOM * free_bytes
    fit = [
        n
        for n in range(1, cfg.n_layers + 1)
        if memory_estimate(cfg, n, tokens, published_point)["total"] <= budget
    ]
    return max(fit, default=0)
