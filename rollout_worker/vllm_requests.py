"""Client-side state of the vLLM engine's requests: one streamed request, and kept sequences.

`RequestState` collects one vLLM request's streamed tokens, behaviour logprobs and kept sets, and
watches for stop sequences. vLLM's own `stop_token_ids` are single tokens; a stop sequence (a token
run such as the closing fence of a ```bash block) is matched here on the streamed tokens, the
request is aborted, and the tokens vLLM streamed past the match are dropped.

`KeptSequences` is multi-turn continuation (`generate(keep=True)` / `extend` / `release`, the
interface the torch engine has). vLLM cannot park a finished request and feed it more tokens, so a
kept sequence lives here as the exact token ids it has so far: prompt, every generated token, every
appended observation. `extend` submits a new vLLM request whose prompt is those ids plus the
appended ones: ids in, ids out, nothing is re-tokenised. With prefix caching on, vLLM finds the
earlier turns' KV blocks (computed while they were generated) by the hash of those ids and
prefills only the rest: the observation and the last partial block. Each kept sequence has its
own cache salt, so its blocks serve only its own continuations (like the torch engine's kept slot:
KV computed under the weights of its time) and a fresh prompt never picks up KV computed under
other weights. Blocks that vLLM evicted under memory pressure are recomputed under the current
weights; the behaviour logprobs are vLLM's own either way, so the trainer's IS ratio stays exact.

`StreamMetrics` turns the streamed outputs into the engine's step metrics the way the torch engine
measures them (busy time, update stall); it needs no vLLM, so its bookkeeping is tested in the
default suite (tests/test_vllm_stall_measure.py).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

import numpy as np

import policy
from kernel.log import get_logger
from policy.sampling import FULL

from .engine import EngineMetrics

log = get_logger(__name__)


def find_stop(tokens: list[int], start: int, stop_seqs: tuple[tuple[int, ...], ...]) -> int | None:
    """Length of `tokens` up to the end of the first stop sequence whose last token is at index >= start."""
    for end in range(max(start, 0) + 1, len(tokens) + 1):
        for q in stop_seqs:
            if end >= len(q) and tuple(tokens[end - len(q) : end]) == q:
                return end
    return None


@dataclass
class RequestState:
    """One vLLM request as it streams: tokens, logprobs, kept sets; where a stop sequence ended."""

    stop_seqs: tuple[tuple[int, ...], ...] = ()
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list[np.ndarray | None] = field(default_factory=list)
    last_t: float = 0.0
    stop_at: int | None = None  # tokens[:stop_at] is the completion (a stop sequence matched)

    def add(self, new: list[int], logprobs, greedy: bool, truncated: bool) -> None:
        """One streamed step's tokens with vLLM's processed logprobs (top-n: the kept set)."""
        for i, tok in enumerate(new):
            lp = logprobs[i] if logprobs else None
            if greedy:  # the kept set of a greedy step is its one token: logprob 0
                self.logprobs.append(0.0)
                self.kept.append(np.array([tok], np.int32))
                continue
            if lp is None or tok not in lp:
                raise RuntimeError(f"vLLM returned no logprob for sampled token {tok}")
            self.logprobs.append(float(lp[tok].logprob))
            if truncated:
                ids = np.fromiter((t for t, v in lp.items() if math.isfinite(v.logprob)), np.int64)
                vals = np.fromiter((lp[t].logprob for t in ids), np.float64, len(ids))
                self.kept.append(ids[np.argsort(-vals, kind="stable")].astype(np.int32))
            else:
                self.kept.append(None)
        before = len(self.tokens)
        self.tokens.extend(new)
        if self.stop_seqs and self.stop_at is None:  # only matches that end in the new tokens
            self.stop_at = find_stop(self.tokens, before, self.stop_seqs)

    def cut(self) -> None:
        """Drop what vLLM generated past the stop sequence (before the abort reached it)."""
        n = self.stop_at
        if n is not None:
            del self.tokens[n:], self.logprobs[n:], self.kept[n:]

    def mask(self) -> policy.SamplingMask:
        if all(k is None for k in self.kept):
            return policy.SamplingMask.full(len(self.kept))
        counts = [FULL if k is None else len(k) for k in self.kept]
        ids = [k for k in self.kept if k is not None]
        return policy.SamplingMask(counts, np.concatenate(ids) if ids else np.zeros(0, np.int32))


class StreamMetrics:
    """EngineMetrics from vLLM's streamed outputs, measured as the torch engine measures them.

    busy_s: time between two outputs while a request is in flight; an idle engine, or one paused
    for an update, is not busy. Update stall: per request, the gap between its last token before the
    update and its first token after it, for the requests that had streamed a token when the update
    loaded (one still prefilling, or submitted after the update, was decoding nothing); the first of
    them to stream again closes it. An update with none of them records its apply with no stall."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self.last_out: float | None = None  # last output of any request; None while idle
        self.stall: tuple[float, set[str]] | None = None  # (apply_s, requests decoding at the update)

    def output(self, rid: str, req: RequestState, n: int, active: int, now: float) -> None:
        """`n` new tokens of request `rid` streamed at `now`, `active` requests in flight."""
        m = self.metrics
        if req.last_t:
            m.step_ms.append((now - req.last_t) * 1e3)
        m.tokens += n
        if self.last_out is not None:
            m.busy_s += now - self.last_out
        m.occupancy.append(active / m.slots)
        if self.stall is not None and rid in self.stall[1]:  # its first token after the update
            stall_s = now - req.last_t
            m.update(self.stall[0], stall_s)
            log.info("update stall closed", stall_ms=round(stall_s * 1e3, 1), closed_by=rid)
            self.stall = None
        req.last_t = self.last_out = now

    def left(self, rid: str, active: int) -> None:
        """Request `rid` is gone (finished, failed or cancelled); `active` are still in flight."""
        if not active:
            self.last_out = None  # idle from here on: not busy time
        if self.stall is not None:
            self.stall[1].discard(rid)
            if not self.stall[1]:  # all of them ended with no token after the update
                self.metrics.update(self.stall[0], None)
                self.stall = None

    def loaded(self, reqs: dict[str, RequestState], apply_s: float, now: float) -> None:
        """An update finished loading at `now`, vLLM still paused: every output from here on comes
        after it (also one streamed while resume_generation is awaited)."""
        if self.stall is not None:  # two updates before one token: count both, one stall
            self.metrics.update(self.stall[0], None)
        decoding = {rid for rid, r in reqs.items() if r.last_t}
        self.stall = (apply_s, decoding) if decoding else None
        if not decoding:
            self.metrics.update(apply_s, None)
        if self.last_out is not None:
            self.last_out = now  # the paused apply is not busy time (torch: decode steps only)


def token_versions(spans, n: int) -> tuple[list[int], int]:
    """Per-token versions (and the last epoch) from vLLM's weight-version spans ("v@epoch" labels)."""
    if not spans:
        raise RuntimeError("vLLM reported no weight-version spans for a finished request")
    out = np.empty(n, np.int64)
    epoch = -1
    for s in spans:
        v, _, e = s.version.partition("@")
        out[s.start : s.end] = int(v)
        epoch = int(e or -1)
    if spans[0].start != 0 or spans[-1].end != n:
        raise RuntimeError(f"weight-version spans {spans} do not cover the {n} tokens")
    return out.tolist(), epoch


@dataclass
class Kept:
    ids: list[int]  # every id so far: prompt, generated tokens, appended observations
    seed: int
    salt: str  # vLLM cache salt: this sequence's KV blocks serve only its continuations
    turns: int = 1
    busy: bool = False  # a continuation is generating (one at a time)


class KeptSequences:
    """handle -> Kept. A handle is valid from generate(keep=True) until release()."""

    def __init__(self) -> None:
        self._kept: dict[int, Kept] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._kept)

    @staticmethod
    def new_salt() -> str:
        return uuid.uuid4().hex

    def add(self, ids: list[int], seed: int, salt: str) -> int:
        h, self._next = self._next, self._next + 1
        self._kept[h] = Kept(list(ids), int(seed), salt)
        return h

    def begin(self, handle: int) -> Kept:
        """The kept sequence to continue, marked busy; ValueError when released or generating."""
        k = self._kept.get(handle)
        if k is None or k.busy:
            raise ValueError(f"no kept sequence with handle {handle} (released, or still generating)")
        k.busy = True
        return k

    def end(self, handle: int, k: Kept, ids: list[int] | None) -> None:
        """A continuation ended: `ids` (everything so far) on success, None on failure (unchanged)."""
        k.busy = False
        if ids is not None and self._kept.get(handle) is k:
            k.ids, k.turns = list(ids), k.turns + 1

    def release(self, handle: int) -> None:
        self._kept.pop(handle, None)  # idempotent; a continuation in flight still returns
