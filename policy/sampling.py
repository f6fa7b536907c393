"""The sampling transform shared by engine and trainer: temperature, top-k, top-p ->
sampled token, its behaviour logprob under the truncated + renormalised distribution, and a
compact mask of the kept set so the trainer can rebuild exactly that distribution."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

FULL = -1  # mask count meaning "nothing truncated": the whole vocab was kept, nothing shipped
ZSTD_MIN_IDS = 256  # above this many kept ids the wire form is delta-coded + zstd
MAX_WIRE_IDS = 1 << 28  # refuse decompression bombs


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    def __post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k}")

    @property
    def truncates(self) -> bool:
        return self.temperature == 0 or self.top_p < 1 or self.top_k > 0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    @classmethod
    def from_dict(cls, d: dict) -> SamplingConfig:
        """Accepts a bus SamplingParams dict (its other keys: max_tokens, n, stop are not ours)."""
        return cls(
            temperature=float(d.get("temperature", 1.0)),
            top_p=float(d.get("top_p", 1.0)),
            top_k=int(d.get("top_k", 0)),
        )


class SamplingMask:
    """Kept set per sampled token, CSR-like: counts[i] kept ids for row i (FULL = whole vocab,
    no ids stored), ids = concatenation of each row's kept ids (ascending within a row, as sample()
    makes them)."""

    def __init__(self, counts, ids):
        self.counts = np.asarray(counts, dtype=np.int32).reshape(-1)
        self.ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        self._offsets = None
        if (self.counts < FULL).any() or (self.counts == 0).any():
            raise ValueError("mask counts must be >= 1 or FULL (-1)")
        if int(np.clip(self.counts, 0, None).sum()) != len(self.ids):
            raise ValueError(
                f"mask counts sum {int(np.clip(self.counts, 0, None).sum())} != {len(self.ids)} ids"
            )
        if len(self.ids) and self.ids.min() < 0:
            raise ValueError("mask ids must be >= 0")

    def __len__(self) -> int:
        return len(self.counts)

    def __repr__(self) -> str:
        return f"SamplingMask(rows={len(self)}, full={int((self.counts == FULL).sum())}, ids={len(self.ids)})"

    def __eq__(self, other) -> bool:
        """Same kept sets row by row (order of ids within a row does not matter)."""
        if not isinstance(other, SamplingMask) or not np.array_equal(self.counts, other.counts):
            return False
        rows = np.repeat(np.arange(len(self)), np.clip(self.counts, 0, None))
        return np.array_equal(
            self.ids[np.lexsort((self.ids, rows))], other.ids[np.lexsort((other.ids, rows))]
        )

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:  # arrays are never mutated after construction: compute once
            self._offsets = np.concatenate([[0], np.cumsum(np.clip(self.counts, 0, None))]).astype(np.int64)
        return self._offsets

    @classmethod
    def full(cls, rows: int) -> SamplingMask:
        return cls(np.full(rows, FULL, np.int32), np.zeros(0, np.int32))

    def row(self, i: int) -> np.ndarray | None:
        """Kept ids of row i, or None when the whole vocab was kept."""
        if self.counts[i] == FULL:
            return None
        o = self.offsets
        return self.ids[o[i] : o[i + 1]]

    def __getitem__(self, sl) -> SamplingMask:
        if isinstance(sl, int):
            sl = slice(sl, sl + 1 if sl != -1 else None)
        if not isinstance(sl, slice) or sl.step not in (None, 1):
            raise TypeError("SamplingMask supports int or contiguous slice indexing")
        a, b, _ = sl.indices(len(self))
        o = self.offsets
        return SamplingMask(self.counts[a:b], self.ids[o[a] : o[max(a, b)]])

    def row_parts(self) -> list[tuple[int, np.ndarray | None]]:
        """(count, kept ids or None when the whole vocab was kept) per row: what a decode loop
        appends to each sequence per token, without building a mask object per token."""
        o, counts = self.offsets, self.counts.tolist()
        return [(c, None if c == FULL else self.ids[o[i] : o[i + 1]]) for i, c in enumerate(counts)]

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[int, np.ndarray | None]]) -> SamplingMask:
        """The mask of rows collected from `row_parts` (one sequence's tokens, in order)."""
        ids = [r for _, r in rows if r is not None]
        return cls([c for c, _ in rows], np.concatenate(ids) if ids else np.zeros(0, np.int32))

    @classmethod
    def concat(cls, masks: Sequence[SamplingMask]) -> SamplingMask:
        if not masks:
            return cls.full(0)
        return cls(np.concatenate([m.counts for m in masks]), np.concatenate([m.ids for m in masks]))

    def to_wire(self) -> dict:
        """msgpack-able primitives; an untruncated sequence ships only its length. Large kept sets
        (flat distributions, big vocabularies) ship as per-row sorted, delta-coded, zstd ids."""
        if (self.counts == FULL).all():
            return {"format": "full", "rows": len(self)}
        counts = self.counts.astype("<i4").tobytes()
        if len(self.ids) <= ZSTD_MIN_IDS:
            return {
                "format": "csr1",
                "rows": len(self),
                "counts": counts,
                "ids": self.ids.astype("<i4").tobytes(),
            }
        rows = np.repeat(np.arange(len(self)), np.clip(self.counts, 0, None))
        ids = self.ids[np.lexsort((self.ids, rows))].astype(np.int64)
        delta = np.diff(ids, prepend=0)
        delta[self.offsets[:-1][self.counts > 0]] = ids[
            self.offsets[:-1][self.counts > 0]
        ]  # row starts absolute
        return {
            "format": "csr1z",
            "rows": len(self),
            "counts": counts,
            "ids": zstandard.ZstdCompressor(level=3).compress(delta.astype("<i4").tobytes()),
        }

    @classmethod
    def from_wire(cls, d: dict) -> SamplingMask:
        if not isinstance(d, dict) or "format" not in d or "rows" not in d:
            raise ValueError(f"bad sampling mask wire form: {str(d)[:80]}")
        rows = int(d["rows"])
        if d["format"] == "full":
            return cls.full(rows)
        if d["format"] not in ("csr1", "csr1z"):
            raise ValueError(f"unknown sampling mask format {d['format']!r}")
        cb, ib = d.get("counts"), d.get("ids")
        if not isinstance(cb, (bytes, bytearray)) or not isinstance(ib, (bytes, bytearray)):
            raise ValueError("sampling mask counts/ids must be int32 byte strings")
        if d["format"] == "csr1z":
            try:
                ib = zstandard.ZstdDecompressor().decompress(ib, max_output_size=MAX_WIRE_IDS * 4)
            except zstandard.ZstdError as e:
                raise ValueError(f"sampling mask ids do not decompress: {e}") from None
        if len(cb) % 4 or len(ib) % 4:
            raise ValueError("sampling mask counts/ids must be int32 byte strings")
        counts, ids = np.frombuffer(cb, "<i4"), np.frombuffer(ib, "<i4")
        if d["format"] == "csr1z":
            if (
                int(np.clip(counts, 0, None).sum()) != len(ids)
                or (counts == 0).any()
                or (counts < FULL).any()
            ):
                raise ValueError("sampling mask counts do not match its ids")
            # undo the per-row delta coding: cumulative sum minus the running total before each row
            c = np.cumsum(ids.astype(np.int64))
            n = np.clip(counts, 0, None)
            starts = np.concatenate([[0], np.cumsum(n)])[:-1][n > 0]
            base = np.where(starts > 0, c[np.maximum(starts - 1, 0)], 0)
            ids = c - np.repeat(base, n[n > 0])
            if len(ids) and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
                raise ValueError("sampling mask ids out of range after decoding")
        m = cls(counts, ids)
        if len(m) != rows:
            raise ValueError(f"sampling mask has {len(m)} rows, header says {rows}")
        return m

    def keep_matrix(self, vocab_size: int, device=None) -> torch.Tensor:
        """Bool [rows, V]: True where the token was in the kept set."""
        if len(self.ids) and int(self.ids.max()) >= vocab_size:
            raise ValueError(f"mask id {int(self.ids.max())} >= vocab size {vocab_size}")
        counts = torch.from_numpy(self.counts.astype(np.int64)).to(device)
        keep = torch.zeros(len(self), vocab_size, dtype=torch.bool, device=device)
        keep[counts == FULL] = True
        rows = torch.repeat_interleave(torch.arange(len(self), device=device), counts.clamp(min=0))
        keep[rows, torch.from_numpy(self.ids.astype(np.int64)).to(device)] = True
        return keep


@dataclass
class SampleOut:
    tokens: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] fp32 behaviour logprobs (truncated, renormalised)
    mask: SamplingMask  # B rows


def sampling_tensors(cfg, n: int, device=None):
    """Per-row temperature/top_p/top_k tensors from one SamplingConfig or one per row."""
    cfgs = [cfg] * n if isinstance(cfg, SamplingConfig) else list(cfg)
    if len(cfgs) != n:
        raise ValueError(f"got {len(cfgs)} sampling configs for {n} rows")
    t = torch.tensor([c.temperature for c in cfgs], dtype=torch.float32, device=device)
    p = torch.tensor([c.top_p for c in cfgs], dtype=torch.float32, device=device)
    k = torch.tensor([c.top_k for c in cfgs], dtype=torch.long, device=device)
    return t, p, k


def scale_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [N, V] / temperature [N] in fp32; greedy rows (T=0) keep T=1 (their kept set is 1 id)."""
    return logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]


def truncation(scaled: torch.Tensor, temperature, top_p, top_k):
    """Kept set of each row in descending order: (order [N,V], keep_sorted [N,V] bool prefix)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(-1)
    mass_before = torch.cat([torch.zeros_like(probs[:, :1]), torch.cumsum(probs, -1)[:, :-1]], -1)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None]
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)  # top_p=1 must keep the float tail too
    keep &= (top_k[:, None] == 0) | (rank < top_k[:, None])
    keep &= (temperature[:, None] > 0) | (rank == 0)
    keep[:, 0] = True
    return order, keep


def truncated_logprobs(scaled: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """log_softmax over the kept set only (renormalised); -inf outside it."""
    return scaled.masked_fill(~keep, float("-inf")).log_softmax(-1)


def sample(logits: torch.Tensor, cfg, generator: torch.Generator | None = None) -> SampleOut:
    """logits [B, V] -> one token per row from the truncated, renormalised distribution."""
    if logits.dim() != 2:
        raise ValueError(f"sample expects logits [B, V], got shape {tuple(logits.shape)}")
    B, V = logits.shape
    # -inf is a legitimate "banned token"; NaN, +inf or a row with nothing finite is a broken model
    broken = (torch.isnan(logits) | torch.isposinf(logits)).any(-1) | torch.isneginf(logits).all(-1)
    if broken.any():
        bad = broken.nonzero()[:, 0][:5].tolist()
        raise ValueError(f"non-finite logits in rows {bad}: refusing to sample from a broken distribution")
    temperature, top_p, top_k = sampling_tensors(cfg, B, logits.device)
    scaled = scale_logits(logits, temperature)
    full = (top_p >= 1) & (top_k == 0) & (temperature > 0)
    if bool(full.all()):  # nothing truncated: no sort, the kept set is the vocab (same numbers as below)
        logp, mask = scaled.log_softmax(-1), SamplingMask.full(B)
    else:
        order, keep_sorted = truncation(scaled, temperature, top_p, top_k)
        keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
        logp = truncated_logprobs(scaled, keep)
        counts = keep_sorted.sum(-1).to(torch.int32)
        counts[full] = FULL
        ids = keep[~full].nonzero()[:, 1]  # row-major, ascending ids within each row
        mask = SamplingMask(counts.cpu().numpy(), ids.to(torch.int32).cpu().numpy())
    tokens = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return SampleOut(tokens, logp.gather(1, tokens[:, None])[:, 0], mask)
