"""A small Llama-style causal transformer (RMSNorm, SwiGLU, RoPE) with two attention kinds:
GQA, and MLA (DeepSeek-V2: KV compressed to a low-rank latent plus a decoupled RoPE key shared
by all heads). One code path serves teacher-forced training (`forward`) and KV-cached
incremental decoding (`prefill` / `decode`), so trainer and workers run the same numerics."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig, QuantConfig
from .quant import fake_quant


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32 like HF Llama, whatever the param dtype (one fused kernel:
        # x * rsqrt(mean(x^2) + eps))
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class QLinear(nn.Linear):
    """nn.Linear with optional fp8 fake-quant of its input (per token, 'linear_act') and of its
    weight (per output channel, 'linear_weight')."""

    quant: QuantConfig | None = None

    def forward(self, x):
        w, q = self.weight, self.quant
        if q is not None and q.on("linear_act"):
            x = fake_quant(x, q.block)
        if q is not None and q.on("linear_weight"):
            w = fake_quant(w, q.block)
        return F.linear(x, w, self.bias)


def rope_frequencies(dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies (float64) with optional scaling. Llama 3: wavelengths beyond
    original_len / low_freq_factor are stretched by `factor`, those below original_len /
    high_freq_factor are kept, and the band between is interpolated smoothly."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    kind = (scaling or {}).get("rope_type")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        f, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        orig = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((orig / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0: long waves, 1: short waves
        return (1 - smooth) * inv_freq / f + smooth * inv_freq
    if kind is not None:
        raise ValueError(f"rope_scaling {kind!r} not supported")
    return inv_freq


def rope_tables(dim: int, max_len: int, theta: float, scaling: dict | None = None):
    inv_freq = rope_frequencies(dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], -1)  # HF "rotate_half" layout, so HF q/k weights load as is
    return emb.cos().float(), emb.sin().float()


def apply_rope(x, cos, sin):
    """x [B, T, ..., D]; cos/sin [B, T, D] gathered at each token's absolute position."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, -1)
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class KVCache:
    """Per-slot KV cache: slots decode independently, each at its own length (continuous batching).
    GQA stores k/v per kv-head, head-major ([.., slot, head, pos, d]: each head's keys are one
    contiguous run, as attention reads them); MLA stores only the normalised latent c_kv and the
    roped k_rope."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, dtype=torch.float32, device=None):
        if slots <= 0 or max_len <= 0:
            raise ValueError(f"KVCache needs slots > 0 and max_len > 0, got {slots}, {max_len}")
        if max_len > cfg.max_seq_len:
            raise ValueError(f"KVCache max_len {max_len} > model max_seq_len {cfg.max_seq_len}")
        self.cfg, self.slots, self.max_len = cfg, slots, max_len
        L = cfg.n_layers
        if cfg.attn == "gqa":
            shape = (L, slots, cfg.n_kv_heads, max_len, cfg.head_dim)
            self.a = torch.zeros(shape, dtype=dtype, device=device)  # keys
            self.b = torch.zeros(shape, dtype=dtype, device=device)  # values
        else:
            self.a = torch.zeros(L, slots, max_len, cfg.kv_lora_rank, dtype=dtype, device=device)  # c_kv
            self.b = torch.zeros(L, slots, max_len, cfg.qk_rope_dim, dtype=dtype, device=device)  # k_rope
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0  # stale entries are masked out by position, no need to zero them

    def write_and_read(self, layer: int, slots, pos, a_new, b_new):
        """Store this step's entries at (slot, pos) and return each slot's history up to its end
        (GQA: a_new/b_new [B, T, heads, d] in, [B, heads, n, d] out). `slots`: an index tensor, or
        a slice for a run of neighbouring slots (reads are views)."""
        rows = slots[:, None] if torch.is_tensor(slots) else torch.arange(slots.start, slots.stop)[:, None]
        n = int(pos.max()) + 1
        if self.cfg.attn == "gqa":
            self.a[layer, rows, :, pos] = a_new.to(self.a.dtype)
            self.b[layer, rows, :, pos] = b_new.to(self.b.dtype)
            return self.a[layer, slots, :, :n], self.b[layer, slots, :, :n]
        self.a[layer, rows, pos] = a_new.to(self.a.dtype)
        self.b[layer, rows, pos] = b_new.to(self.b.dtype)
        return self.a[layer, slots, :n], self.b[layer, slots, :n]


def attend(q, k, v, pos, causal_full: bool, mask=None):
    """q [B,H,T,d], k [B,Hk,S,d], v [B,Hk,S,dv] (Hk divides H: grouped-query heads share k/v).
    Full forward: plain causal mask, or `mask` [B, T, T] bool (True: key visible) where the
    caller packs several sequences into a row (policy/packing.py). Cached: key j is visible to
    the query at absolute position p iff j <= p (each slot has its own length)."""
    gqa = k.shape[1] != q.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
    if causal_full:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    keys = torch.arange(k.shape[2], device=q.device)
    mask = torch.where(keys[None, None, None, :] <= pos[:, None, :, None], 0.0, float("-inf"))
    (B, H, T, d), Hk = q.shape, k.shape[1]
    if gqa and T == 1:
        # one decode token: the query heads sharing a kv head become that head's query rows, so
        # the kernel loops over B*Hk (not B*H) tiny problems, which is faster at many slots
        return F.scaled_dot_product_attention(q.reshape(B, Hk, H // Hk, d), k, v, attn_mask=mask).reshape(
            B, H, 1, -1
        )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class GQAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, Hk, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = QLinear(cfg.d_model, H * D, bias=cfg.qkv_bias)
        self.k_proj = QLinear(cfg.d_model, Hk * D, bias=cfg.qkv_bias)
        self.v_proj = QLinear(cfg.d_model, Hk * D, bias=cfg.qkv_bias)
        self.o_proj = QLinear(H * D, cfg.d_model, bias=False)
        self.quant = QuantConfig()

    def forward(self, x, cos, sin, pos, cache=None, layer=0, slots=None, mask=None):
        c, (B, T, _) = self.cfg, x.shape
        q = apply_rope(self.q_proj(x).view(B, T, c.n_heads, c.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, c.n_kv_heads, c.head_dim), cos, sin)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, c.head_dim)
        if cache is not None:
            k, v = cache.write_and_read(layer, slots, pos, k, v)  # [B, Hk, S, d]
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        y = attend(q.transpose(1, 2), k, v, pos, causal_full=cache is None, mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, dq = cfg.n_heads, cfg.qk_nope_dim + cfg.qk_rope_dim
        if cfg.q_lora_rank:
            self.q_a_proj = QLinear(cfg.d_model, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = QLinear(cfg.q_lora_rank, H * dq, bias=False)
        else:
            self.q_proj = QLinear(cfg.d_model, H * dq, bias=False)
        self.kv_a_proj = QLinear(cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.kv_b_proj = QLinear(cfg.kv_lora_rank, H * (cfg.qk_nope_dim + cfg.v_head_dim), bias=False)
        self.o_proj = QLinear(H * cfg.v_head_dim, cfg.d_model, bias=False)
        self.quant = QuantConfig()

    def forward(self, x, cos, sin, pos, cache=None, layer=0, slots=None, mask=None):
        c, (B, T, _) = self.cfg, x.shape
        H, dn, dr = c.n_heads, c.qk_nope_dim, c.qk_rope_dim
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if c.q_lora_rank else self.q_proj(x)
        q_nope, q_rope = q.view(B, T, H, dn + dr).split([dn, dr], -1)
        c_kv, k_rope = self.kv_a_proj(x).split([c.kv_lora_rank, dr], -1)
        c_kv = self.kv_a_norm(c_kv)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        if self.quant.on("mla_rope_qk"):
            # per (token, head) scales: the engine decodes one position at a time, the trainer replays all
            q_rope, k_rope = fake_quant(q_rope, self.quant.block), fake_quant(k_rope, self.quant.block)
        if cache is not None:
            c_kv, k_rope = cache.write_and_read(layer, slots, pos, c_kv, k_rope)
        S = c_kv.shape[1]
        k_nope, v = self.kv_b_proj(c_kv).view(B, S, H, dn + c.v_head_dim).split([dn, c.v_head_dim], -1)
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(B, S, H, dr)], -1)
        q = torch.cat([q_nope, q_rope], -1)
        y = attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos, causal_full=cache is None, mask=mask
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = QLinear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = QLinear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = QLinear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = GQAttention(cfg) if cfg.attn == "gqa" else MLAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, pos, cache, layer, slots, mask=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, pos, cache, layer, slots, mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.reset_rope()
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2 style: scale residual projections by depth
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))
        self.quant = quant or QuantConfig()

    def reset_rope(self) -> None:
        rope_dim = self.cfg.head_dim if self.cfg.attn == "gqa" else self.cfg.qk_rope_dim
        cos, sin = rope_tables(rope_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.cfg.rope_scaling)
        dev = self.rope_cos.device if self.rope_cos.device.type != "meta" else None
        self.rope_cos, self.rope_sin = cos.to(dev), sin.to(dev)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    @property
    def quant(self) -> QuantConfig:
        return self._quant

    @quant.setter
    def quant(self, q: QuantConfig):
        """Quant replay is a model setting: engine and trainer build their model with the same one."""
        if q is None:
            q = QuantConfig()
        if not isinstance(q, QuantConfig):
            raise TypeError(f"model.quant must be a QuantConfig, got {type(q).__name__}")
        if q.on("mla_rope_qk") and self.cfg.attn != "mla":
            raise ValueError("quant site 'mla_rope_qk' needs attn='mla'")
        self._quant = q
        for blk in self.layers:
            blk.attn.quant = q
            for m in blk.modules():
                if isinstance(m, QLinear):
                    m.quant = q

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _run(self, idx, pos, cache=None, slots=None, head=None, mask=None):
        if int(pos.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(pos.max())} >= max_seq_len {self.cfg.max_seq_len}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.cfg.vocab_size):
            raise ValueError(
                f"token id out of range [0, {self.cfg.vocab_size}): "
                f"min {int(idx.min())}, max {int(idx.max())}"
            )
        x = self.tok_emb(idx)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        for i, blk in enumerate(self.layers):
            x = blk(x, cos, sin, pos, cache, i, slots, mask)
        x = self.norm(x)
        w = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        if head is not None:
            return head(x, w)
        return F.linear(x, w).float()

    def forward(self, idx: torch.Tensor, head=None, pos=None, mask=None):
        """Teacher-forced causal forward: idx [B, T] -> logits [B, T, V] (fp32). With `head`, the
        result of head(hidden [B, T, d], output weight [V, d]) instead of the full projection:
        called inside forward, where FSDP2 holds the root's parameters gathered, so a caller can
        project only the positions it needs, a few at a time (policy.sequence_logprobs).
        Packed rows (policy/packing.py): `pos` [B, T] each token's position in its own sequence
        and `mask` [B, T, T] bool (True: the query may attend to the key) instead of causal."""
        B, T = idx.shape
        if (pos is None) != (mask is None):
            raise ValueError("a packed forward needs both pos and mask")
        if pos is None:
            pos = torch.arange(T, device=idx.device).expand(B, T)
        elif pos.shape != idx.shape or mask.shape != (B, T, T):
            raise ValueError(
                f"packed forward: pos {tuple(pos.shape)} and mask {tuple(mask.shape)} for idx {(B, T)}"
            )
        return self._run(idx, pos, head=head, mask=mask)

    def _cached(self, idx, cache: KVCache, slots: torch.Tensor):
        if len(torch.unique(slots)) != len(slots):
            raise ValueError(f"duplicate slots in one step: {slots.tolist()}")
        if int(slots.min()) < 0 or int(slots.max()) >= cache.slots:
            raise ValueError(f"slot out of range [0, {cache.slots}): {slots.tolist()}")
        start = cache.lengths[slots]
        T = idx.shape[1]
        if int(start.max()) + T > cache.max_len:
            raise ValueError(f"KV cache full: slot length {int(start.max())} + {T} > max_len {cache.max_len}")
        pos = start[:, None] + torch.arange(T, device=idx.device)
        first = int(slots[0])
        if torch.equal(slots, torch.arange(first, first + len(slots), device=slots.device)):
            # a run of neighbouring slots (a busy engine decodes all of them): KV read as views, no gather
            logits = self._run(idx, pos, cache, slice(first, first + len(slots)))
        else:
            logits = self._run(idx, pos, cache, slots)
        cache.lengths[slots] += T
        return logits

    @torch.no_grad()
    def prefill(self, prompt_ids, cache: KVCache, slot: int) -> torch.Tensor:
        """Append a prompt to `slot` (normally just reset) and return the last position's logits [V]."""
        return self.prefill_many([prompt_ids], cache, [slot])[0]

    @torch.no_grad()
    def prefill_many(self, prompts, cache: KVCache, slots) -> torch.Tensor:
        """Append prompts[i] to slots[i]; last-position logits [N, V] in input order. Prompts of
        one length share a forward (a task's group arrives together with one prompt), so a busy
        engine pays one prefill per group, not per sequence."""
        if len(prompts) != len(slots):
            raise ValueError(f"prefill_many got {len(prompts)} prompts for {len(slots)} slots")
        dev = cache.lengths.device
        ids = [torch.as_tensor(p, dtype=torch.long, device=dev).reshape(-1) for p in prompts]
        if any(len(x) == 0 for x in ids):
            raise ValueError("prefill needs a non-empty prompt")
        out = torch.empty(len(ids), self.cfg.vocab_size, device=dev)
        by_len: dict[int, list[int]] = {}
        for i, x in enumerate(ids):
            by_len.setdefault(len(x), []).append(i)
        for rows in by_len.values():
            batch = torch.stack([ids[i] for i in rows])
            out[rows] = self._cached(batch, cache, torch.tensor([slots[i] for i in rows], device=dev))[:, -1]
        return out

    @torch.no_grad()
    def decode(self, tokens, cache: KVCache, slots) -> torch.Tensor:
        """One token for each listed slot (any subset, each at its own length) -> logits [B, V]."""
        dev = cache.lengths.device
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=dev).reshape(-1, 1)
        slots = torch.as_tensor(slots, dtype=torch.long, device=dev).reshape(-1)
        if tokens.shape[0] != slots.shape[0]:
            raise ValueError(f"decode got {tokens.shape[0]} tokens for {slots.shape[0]} slots")
        return self._cached(tokens, cache, slots)[:, 0]

    def load_inference_state(self, state: dict) -> None:
        """Copy published (e.g. bf16) tensors into the params, upcasting; all-or-nothing."""
        params = dict(self.named_parameters())
        missing, unknown = set(params) - set(state), set(state) - set(params)
        bad = [n for n in params.keys() & state.keys() if tuple(state[n].shape) != tuple(params[n].shape)]
        if missing or unknown or bad:
            raise ValueError(
                f"inference state does not fit the model: missing {sorted(missing)[:5]}, "
                f"unknown {sorted(unknown)[:5]}, wrong shape {sorted(bad)[:5]}"
            )
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state[n])


@torch.no_grad()
def inference_state(model: Transformer, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """What the trainer publishes and workers hold: every parameter cast to the inference dtype."""
    return {n: p.detach().to(dtype).clone() for n, p in model.named_parameters()}
