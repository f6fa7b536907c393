"""The inference-engine interface shared by the torch and vLLM engines.

An engine generates completions continuously and takes weight updates at token
boundaries: `apply_delta` / `load_keyframe` only *queue* the update and return once the
decode loop has applied it between two steps, so sequences in flight keep their KV cache
and every token records the version that produced it.

Shared here (so both engines behave the same): the `Generation` result, the update
admission rule (`check_delta`), the queue of pending updates drained at a token boundary
(`UpdateQueue`), and the metrics every engine reports (`EngineMetrics`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from kernel import metrics

if TYPE_CHECKING:  # pragma: no cover
    import torch

    import delta_codec
    from bus.events import SamplingParams


@dataclass
class Generation:
    """One completion, with what the trainer needs to replay the sampler."""

    completion_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each sampled token
    token_versions: list[int]  # policy version that produced each token
    sampling_mask: dict  # policy.SamplingMask in wire form
    finish_reason: str  # stop | length | abort
    wall_s: float
    epoch: int = 0  # trainer epoch of the weights that produced the last token
    quant: dict = field(default_factory=dict)  # policy.QuantConfig wire form used by the engine
    handle: int = -1  # generate(keep=True): the kept sequence to `extend` (torch engine)


class EngineClosed(RuntimeError):
    """The engine stopped before the sequence finished (the worker releases the task: nak)."""


class WeightUpdateError(Exception):
    """A weight update the engine refused; the worker resyncs from the latest keyframe."""


class StaleEpochError(WeightUpdateError):
    """Delta from an older trainer epoch (a deposed leader): refused, no resync needed."""


class VersionGapError(WeightUpdateError):
    """Delta does not start at the engine's version: resync from the latest keyframe."""


@runtime_checkable
class Engine(Protocol):
    version: int  # version of the live weights (the one new tokens get)
    epoch: int

    @property
    def free_slots(self) -> int:
        """Sequences it can start now (may be negative when requests queue); sizes task fetches."""

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, seed: int) -> Generation: ...

    async def apply_delta(self, delta: delta_codec.Delta, epoch: int) -> None:
        """Apply at the next token boundary; raises WeightUpdateError / delta_codec.DeltaError
        (state unchanged) when refused."""

    async def load_keyframe(self, state: dict[str, torch.Tensor], version: int, epoch: int) -> None: ...

    def stats(self) -> dict: ...

    async def close(self) -> None: ...


def check_prompt(prompt_ids, vocab_size: int) -> list[int]:
    """Prompt ids as ints, refused with a clear error when empty or outside the vocabulary."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    return ids


def check_delta(version: int, epoch: int, delta: delta_codec.Delta, delta_epoch: int) -> None:
    """Epoch rule: accept iff delta_epoch >= epoch and from_version == version."""
    if delta_epoch < epoch:
        raise StaleEpochError(
            f"delta v{delta.from_version}->v{delta.to_version} from epoch {delta_epoch} "
            f"< current epoch {epoch}"
        )
    if delta.from_version != version:
        raise VersionGapError(
            f"delta v{delta.from_version}->v{delta.to_version} does not start at engine version {version}"
        )


class UpdateQueue:
    """Weight updates waiting for the next token boundary.

    `submit(fn)` queues a synchronous update and resolves when the decode loop has run it
    (`drain()` between two steps), with its exception if it failed. An idle engine drains
    at once via `kick`, so an update never waits for a sequence to arrive.
    """

    def __init__(self) -> None:
        self._pending: deque[tuple[Callable[[], Any], asyncio.Future]] = deque()
        self.wakeup = asyncio.Event()

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, fn: Callable[[], Any]) -> Awaitable[Any]:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((fn, fut))
        self.wakeup.set()
        return fut

    def drain(self) -> int:
        """Run every queued update in order (called by the decode loop between steps)."""
        n = 0
        while self._pending:
            fn, fut = self._pending.popleft()
            try:
                res = fn()
            except BaseException as e:  # the submitter gets the error; the loop goes on
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(res)
            n += 1
        return n

    def take(self) -> list[tuple[Callable[[], Any], asyncio.Future]]:
        """Hand the queued updates to a caller that runs them elsewhere (e.g. in a thread)."""
        items = list(self._pending)
        self._pending.clear()
        return items

    def fail_all(self, exc: BaseException) -> None:
        while self._pending:
            _, fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(exc)


def _pct(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else 0.0


class EngineMetrics:
    """Tokens/s, slot occupancy, decode step time and update stall over a sliding window."""

    def __init__(self, slots: int, window: int = 4096) -> None:
        self.slots = slots
        self.step_ms: deque[float] = deque(maxlen=window)
        self.gap_ms: deque[float] = deque(
            maxlen=window
        )  # end of one decode step to the next, no update between
        self.occupancy: deque[float] = deque(maxlen=window)
        self.stall_ms: deque[float] = deque(maxlen=window)
        self.apply_ms: deque[float] = deque(maxlen=window)
        self.stall_excess_ms: deque[float] = deque(maxlen=window)  # stall minus that update's apply time
        # swap mode prepares an update in a thread beside the decode loop: the decode steps it slows
        # are part of that update's cost, so their gaps are kept out of the baseline and their excess
        # over the baseline median is added to the update's stall
        self._prep_gaps: list[float] = []
        self.stall_total_ms: deque[float] = deque(maxlen=window)
        self.stall_steps: deque[float] = deque(maxlen=window)  # total stall / median baseline gap
        self.tokens = 0
        self.updates = 0
        self.refused = 0
        self.started = time.perf_counter()
        self.busy_s = 0.0  # time with at least one active sequence

    def step(self, dt_s: float, active: int, gap_s: float | None = None, preparing: bool = False) -> None:
        self.step_ms.append(dt_s * 1e3)
        if gap_s is not None:
            (self._prep_gaps if preparing else self.gap_ms).append(gap_s * 1e3)
        self.occupancy.append(active / max(self.slots, 1))
        self.tokens += active
        metrics.TOKENS_GENERATED.inc(active)
        self.busy_s += dt_s

    def prep_refused(self) -> None:
        """An update refused while being prepared: the steps it slowed belong to no update."""
        self._prep_gaps = []

    def update(self, apply_s: float, stall_s: float | None, boundary_s: float | None = None) -> None:
        """An update applied in `apply_s`; `stall_s` is the gap between the two decode steps
        straddling it (None when no sequence was in flight, i.e. nothing stalled); `boundary_s`
        the part of the apply done at the token boundary (default: all of it)."""
        self.updates += 1
        self.apply_ms.append(apply_s * 1e3)
        slowed, self._prep_gaps = self._prep_gaps, []
        if stall_s is not None:
            metrics.UPDATE_STALL.observe(stall_s)
            self.stall_ms.append(stall_s * 1e3)
            self.stall_excess_ms.append((stall_s - (apply_s if boundary_s is None else boundary_s)) * 1e3)
            base = float(np.median(self.gap_ms)) if self.gap_ms else 0.0
            total = stall_s * 1e3 + max(0.0, sum(slowed) - base * len(slowed))
            self.stall_total_ms.append(total)
            if base > 0:
                self.stall_steps.append(total / base)

    def snapshot(self) -> dict:
        wall = max(time.perf_counter() - self.started, 1e-9)
        return {
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / wall,
            "tokens_per_busy_s": self.tokens / self.busy_s if self.busy_s > 0 else 0.0,
            "busy_s": self.busy_s,  # decode-step seconds so far (bench.agentic: the decoder's idle share)
            "slot_occupancy": float(np.mean(self.occupancy)) if self.occupancy else 0.0,
            "decode_step_ms_p50": _pct(self.step_ms, 50),
            "step_gap_ms_p50": _pct(self.gap_ms, 50),
            "step_gap_ms_p99": _pct(self.gap_ms, 99),
            "update_stall_ms_p50": _pct(self.stall_ms, 50),
            "update_stall_ms_p99": _pct(self.stall_ms, 99),
            "update_stall_excess_ms_p99": _pct(self.stall_excess_ms, 99),
            "update_stall_total_ms_p50": _pct(self.stall_total_ms, 50),
            "update_stall_total_ms_p99": _pct(self.stall_total_ms, 99),
            "update_stall_steps_p50": _pct(self.stall_steps, 50),
            "update_stall_steps_p99": _pct(self.stall_steps, 99),
            "update_apply_ms_p50": _pct(self.apply_ms, 50),
            "update_apply_ms_p99": _pct(self.apply_ms, 99),
            "updates": self.updates,
            "updates_refused": self.refused,
        }
