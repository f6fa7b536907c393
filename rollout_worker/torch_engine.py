"""The default engine: `policy.Transformer` with a slotted KV cache and continuous batching.

One thread runs the decode loop; each turn of it is one token boundary:

    1. apply pending weight updates (delta_codec.apply_delta on the bf16 state, then copy the
       changed tensors into the model) -- sequences in flight keep their KV cache
    2. admit waiting sequences into free slots (prefill -> first token)
    3. one batched `model.decode` over every active slot, then `policy.sample`
    4. append token / behaviour logprob / version / mask row; a finished sequence frees its
       slot at once, so the next waiting one starts on the following turn

Multi-turn episodes (rollout_worker/episodes.py) continue a sequence: `generate(keep=True)` keeps
the finished sequence's slot and KV cache, `extend(handle, ids)` prefills only the appended ids
(an observation) after it and generates on, `release(handle)` frees the slot. A kept slot is not
free while the episode's command runs: that is the price of never re-prefilling earlier turns.
`kv_slots` (>= `slots`) sizes the KV cache apart from the decode batch: a kept sequence holds a KV
row but no decode row, so with kv_slots > slots more episodes can wait on their commands while
`slots` sequences still decode (at most `slots` sequences get a token per step).

The loop runs in its own thread, turn after turn, without a round trip through the event loop:
NATS heartbeats, acks, rollout publishing and the weight feed stay on the event loop and only
hand sequences and updates over (under `_cv`); finished sequences come back through
`call_soon_threadsafe`. A busy event loop therefore no longer delays the next token.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import torch

import delta_codec
import policy
from bus.events import SamplingParams
from kernel.log import get_logger

from .engine import (
    EngineClosed,
    EngineMetrics,
    Generation,
    UpdateQueue,
    WeightUpdateError,
    check_delta,
    check_prompt,
)

log = get_logger(__name__)


@dataclass
class _Seq:
    prompt_ids: list[int]
    sampling: SamplingParams
    cfg: policy.SamplingConfig
    stop: frozenset[int]
    future: asyncio.Future
    started: float = field(default_factory=time.perf_counter)
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask_rows: list = field(default_factory=list)  # policy.SamplingMask.row_parts, one per token
    finish: str = ""
    epoch: int = 0
    feed: list[int] = field(default_factory=list)  # ids to prefill (the prompt, or a continuation)
    fresh: bool = True  # a new sequence (slot reset) rather than a kept one extended
    keep: bool = False  # finished: keep the slot and its KV cache for `extend`
    stop_seqs: tuple = ()  # token sequences that end the sequence when generated
    handle: int = -1
    parked: bool = False  # finished, slot kept: `extend` may continue it


class TorchEngine:
    """Continuous-batching generation on `policy/` with per-token hot-patching of weights."""

    def __init__(
        self,
        model_config: policy.ModelConfig | dict,
        *,
        slots: int = 8,
        max_len: int = 0,
        quant: policy.QuantConfig | None = None,
        eos_id: int | None = None,
        seed: int = 0,
        threads: int = 0,
        update_mode: str = "swap",
        device: str | torch.device = "cpu",
        kv_slots: int = 0,
    ):
        if isinstance(model_config, dict):
            model_config = policy.ModelConfig.from_dict(model_config)
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        kv_slots = kv_slots or slots
        if kv_slots < slots:
            raise ValueError(
                f"kv_slots ({kv_slots}) must be >= slots ({slots}): every decoding sequence needs a KV row"
            )
        if update_mode not in ("swap", "inline"):
            raise ValueError(f"update_mode must be 'swap' or 'inline', got {update_mode!r}")
        self.update_mode = update_mode
        self.cfg = model_config
        self.quant = quant or policy.QuantConfig()
        self.slots = slots  # decode rows: sequences that get a token per step
        self.kv_slots = kv_slots  # KV cache rows: decoding + kept (parked) sequences
        self.max_len = max_len or model_config.max_seq_len
        if self.max_len > model_config.max_seq_len:
            raise ValueError(
                f"max_len {self.max_len} exceeds the model's max_seq_len {model_config.max_seq_len}"
            )
        self.eos_id = eos_id
        # on a GPU the weights, the KV cache and the published bf16 state live on the device, so a
        # delta is applied there (delta_codec's Triton kernel) and only the compressed bytes cross PCIe
        self.device = torch.device(device)
        self.model = policy.Transformer(model_config, quant=self.quant).to(self.device).eval()
        if self.device.type == "cpu":
            column_major(self.model)
        self.cache = policy.KVCache(model_config, slots=kv_slots, max_len=self.max_len, device=self.device)
        self.state: dict[str, torch.Tensor] | None = None  # bf16 bits as published (deltas apply here)
        self.params = dict(self.model.named_parameters())
        self.version, self.epoch = -1, -1
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        if threads:
            torch.set_num_threads(threads)
        self.metrics = EngineMetrics(slots)
        self.updates = UpdateQueue()
        # the codec's compiled kernels now, not at the first delta (between two decode steps)
        delta_codec.warm()
        self.waiting: list[_Seq] = []
        self.active: dict[int, _Seq] = {}
        self.free = list(range(kv_slots))[::-1]
        self.kept: dict[int, _Seq] = {}  # handle -> finished sequence whose slot is kept for extend()
        self._next_handle = 0
        self._closed = False
        self._cv = threading.Condition()  # guards waiting / updates / _closed between the two threads
        self._last_step_end: float | None = None
        self._stall_from: tuple | None = None  # (prep_s, swap_s, last step end) of an update just swapped in
        self._prep = asyncio.Lock()
        self.spare: dict[str, torch.Tensor] | None = None  # fp32 buffers the next update is prepared in
        self._stale: set[str] = set()
        self._prep_s = 0.0
        self._preparing = False  # an update is being prepared beside the decode loop
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- public interface (rollout_worker.engine.Engine) ---------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
            self._thread.start()

    @property
    def free_slots(self) -> int:
        """KV rows a new sequence could take (minus the new ones already waiting for one)."""
        return len(self.free) - sum(1 for s in self.waiting if s.fresh)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        seed: int = 0,
        *,
        keep: bool = False,
        stop_seqs=(),
    ) -> Generation:
        """A completion of `prompt_ids`. keep=True: the slot and its KV cache stay with the sequence
        after it finishes (Generation.handle) for `extend`; `release` frees them. `stop_seqs`: token
        sequences that end it as well (finish_reason "stop_seq")."""
        if self._closed:
            raise EngineClosed("engine is closed")
        if self.state is None:
            raise RuntimeError("no weights loaded yet: call load_keyframe first")
        prompt_ids = check_prompt(prompt_ids, self.cfg.vocab_size)
        self._check_sampling(sampling, len(prompt_ids))
        seq = self._new_seq(prompt_ids, sampling, stop_seqs, keep)
        seq.feed = prompt_ids
        with self._cv:
            if keep:
                seq.handle, self._next_handle = self._next_handle, self._next_handle + 1
                self.kept[seq.handle] = seq
            self.waiting.append(seq)
            self._cv.notify()
        self.start()
        return await seq.future

    async def extend(
        self, handle: int, append_ids: list[int], sampling: SamplingParams, *, stop_seqs=()
    ) -> Generation:
        """Continue a kept sequence: `append_ids` (e.g. an observation, possibly empty) go after every
        id it has so far and generation goes on. Only the last sampled token and `append_ids` are
        prefilled: earlier ids stay in the slot's KV cache, never re-tokenised nor re-computed.
        The Generation holds the new tokens only; the sequence stays kept (same handle)."""
        if self._closed:
            raise EngineClosed("engine is closed")
        ids = [int(t) for t in append_ids]
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"appended token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        with self._cv:
            prev = self.kept.get(handle)
            if prev is None or not prev.parked:
                raise ValueError(f"no kept sequence with handle {handle} (released, or still generating)")
            length = int(self.cache.lengths[prev.slot])
            self._check_sampling(sampling, length + 1 + len(ids))
            seq = self._new_seq(prev.prompt_ids, sampling, stop_seqs, True)
            # the last sampled token was never fed through the model: it goes first
            seq.feed, seq.fresh, seq.slot, seq.handle = [prev.tokens[-1]] + ids, False, prev.slot, handle
            prev.parked = False  # one continuation at a time
            self.kept[handle] = seq
            self.waiting.insert(0, seq)  # needs no free slot: admitted on the next turn
            self._cv.notify()
        self.start()
        return await seq.future

    def release(self, handle: int) -> None:
        """Free a kept sequence's slot (idempotent; the episode runner calls it in `finally`)."""
        with self._cv:
            s = self.kept.pop(handle, None)
            if s is None:
                return
            if s.parked:
                s.parked = False
                self.free.append(s.slot)
                s.slot = -1
            elif s in self.waiting:  # released before its continuation started
                self.waiting.remove(s)
                if s.slot >= 0:
                    self.free.append(s.slot)
                s.slot = -1
                if not s.future.done():
                    s.future.set_exception(EngineClosed("sequence released"))
            # else it is generating: not in `kept` any more, so its slot is freed when it finishes
            self._cv.notify()

    def _check_sampling(self, sampling: SamplingParams, used: int) -> None:
        if sampling.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        if used + sampling.max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({used}) + max_tokens ({sampling.max_tokens}) exceeds "
                f"the engine's max_len {self.max_len}"
            )

    def _new_seq(self, prompt_ids, sampling: SamplingParams, stop_seqs, keep: bool) -> _Seq:
        cfg = policy.SamplingConfig(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
        )
        stop = frozenset(int(t) for t in sampling.stop) | (
            {self.eos_id} if self.eos_id is not None else set()
        )
        seqs = tuple(tuple(int(t) for t in q) for q in stop_seqs if len(q))
        return _Seq(
            prompt_ids,
            sampling,
            cfg,
            stop,
            asyncio.get_running_loop().create_future(),
            keep=keep,
            stop_seqs=seqs,
        )

    async def apply_delta(self, delta: delta_codec.Delta, epoch: int) -> None:
        await self._checked_update(delta, epoch, lambda: self._prepare_delta(delta))

    async def apply_parts(self, manifest, parts: dict[int, bytes], epoch: int) -> None:
        """A version published from shards (bus/weights/manifest.py), verified by the follower:
        every part applies, in any order, or none (state unchanged)."""
        await self._checked_update(manifest, epoch, lambda: self._prepare_parts(manifest, parts))

    async def _checked_update(self, update, epoch: int, prepare) -> None:
        """A delta or a sharded version: the epoch/version rule first, then prepare and swap."""
        async with self._prep:
            try:
                check_delta(self.version, self.epoch, update, epoch)
            except WeightUpdateError:
                self.metrics.refused += 1
                raise
            await self._update(prepare, update.to_version, epoch)

    async def load_keyframe(self, state: dict[str, torch.Tensor], version: int, epoch: int) -> None:
        async with self._prep:
            await self._update(lambda: self._prepare_keyframe(state), int(version), int(epoch))

    def stats(self) -> dict:
        return {
            **self.metrics.snapshot(),
            "version": self.version,
            "epoch": self.epoch,
            "slots": self.slots,
            "kv_slots": self.kv_slots,
            "kept": len(self.kept),
            "active": len(self.active),
            "waiting": len(self.waiting),
        }

    async def close(self) -> None:
        """Stop: sequences not finished fail with EngineClosed (their tasks get released)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        exc = EngineClosed("engine closed before the sequence finished")
        for s in [*self.waiting, *self.active.values()]:
            if not s.future.done():
                s.future.set_exception(exc)
        self.waiting.clear()
        self.active.clear()
        self.kept.clear()
        self.updates.fail_all(exc)

    # -- weights ------------------------------------------------------------------------
    # Double buffering: an update is prepared off the decode path (delta applied to the bf16
    # state, changed tensors upcast into a spare fp32 buffer) while decoding goes on with the
    # live weights; at the next token boundary the spare and live tensors swap (pointer swaps),
    # so the stall is one swap, not one apply. `_prep` keeps updates one at a time, in order.
    async def _update(self, prepare, version: int, epoch: int) -> None:
        if self._closed:
            raise EngineClosed("engine is closed")
        if self.update_mode == "inline":  # prepare at the boundary itself: stalls, but gets the whole CPU

            def run():
                t = time.perf_counter()
                names = prepare()
                self._swap(names, version, epoch, time.perf_counter() - t)

            try:
                return await self._submit(run)
            except EngineClosed:
                raise
            except BaseException:
                self.metrics.refused += 1
                raise
        t0 = time.perf_counter()
        self._preparing = True
        try:
            names = await asyncio.to_thread(prepare)  # DeltaError/ValueError: nothing changed
        except BaseException:
            self.metrics.refused += 1
            self.metrics.prep_refused()
            raise
        finally:
            self._preparing = False
        prep_s = time.perf_counter() - t0
        await self._submit(lambda: self._swap(names, version, epoch, prep_s))

    def _spare_for(self, names) -> dict[str, torch.Tensor]:
        if self.spare is None:
            self.spare = {k: torch.empty_like(p) for k, p in self.params.items()}
            self._stale = set(self.params)
        return self.spare

    @torch.no_grad()
    def _prepare_delta(self, delta) -> list[str]:
        # verifies digests and refuses a NaN/±inf result (NonFiniteError); refused -> state unchanged
        delta_codec.apply_delta(self.state, delta, finite=True)
        names = set(self._changed_names(delta)) | self._stale
        spare = self._spare_for(names)
        for k in names:
            spare[k].copy_(self.state[k])
        return sorted(names)

    def _prepare_parts(self, manifest, parts: dict[int, bytes]) -> list[str]:
        from delta_codec.sharded import PART_NAME, apply_parts

        apply_parts(self.state, manifest, parts, expect_from=self.version, finite=True)  # all-or-nothing
        changed = {
            PART_NAME.match(n)[1]
            for blob in parts.values()
            for n, st in delta_codec.Delta.from_bytes(blob).stats.per_tensor.items()
            if st["changed"]
        }
        names = changed | self._stale
        spare = self._spare_for(names)
        for k in names:
            spare[k].copy_(self.state[k])
        return sorted(names)

    @torch.no_grad()
    def _prepare_keyframe(self, state) -> list[str]:
        self._check_state(state)
        self.state = {k: v.detach().to(self.params[k].device).clone() for k, v in state.items()}
        spare = self._spare_for(self.params)
        for k in self.params:
            spare[k].copy_(self.state[k])
        return list(self.params)

    def _swap(self, names, version: int, epoch: int, prep_s: float) -> None:
        """At a token boundary: the spare tensors go live (O(1) per tensor)."""
        for k in names:
            p = self.params[k]
            p.data, self.spare[k] = self.spare[k], p.data
        self._stale = set(names)  # the new spare holds the old values of exactly these tensors
        self.version, self.epoch = version, epoch
        self._prep_s = prep_s

    def _check_state(self, state) -> None:
        missing = sorted(set(self.params) - set(state))
        extra = sorted(set(state) - set(self.params))
        if missing or extra:
            raise ValueError(
                f"keyframe does not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        bad = [k for k, p in self.params.items() if tuple(state[k].shape) != tuple(p.shape)]
        if bad:
            raise ValueError(f"keyframe tensor shapes differ from the model: {bad[:5]}")

    @staticmethod
    def _changed_names(delta) -> list[str]:
        """Tensors the delta actually changes (its records cover every tensor)."""
        return [name for name, st in delta.stats.per_tensor.items() if st["changed"]]

    async def _submit(self, fn) -> None:
        if self._closed:
            raise EngineClosed("engine is closed")
        with self._cv:
            fut = self.updates.submit(fn)
            self._cv.notify()
        self.start()
        await fut

    # -- the decode loop -----------------------------------------------------------------
    def _run(self) -> None:
        """The decode thread: one turn after another while there is work, asleep otherwise."""
        while True:
            with self._cv:
                # asleep unless a turn can do something: a new sequence waiting for a KV row that
                # every kept episode holds (all waiting on their commands) must not spin this loop
                while not (self._closed or self.updates or self.active or self._admissible()):
                    self._last_step_end = None  # idle: the next update stalls nobody
                    self._cv.wait()
                if self._closed:
                    return
                pending = self.updates.take()
                admits = self._take_admits()
            try:
                finished = self._turn(pending, admits)
                # the Generation (mask wire form, maybe zstd) is built on the event loop, off the decode
                # thread
                results = [(s.future, None, s) for s in finished]
            except Exception as e:  # a bug in a turn must not hang callers: fail what was in it
                log.exception("engine turn failed", error=str(e))
                results = [(s.future, e, None) for s in [*admits, *self.active.values()]]
                for s in [*admits, *self.active.values()]:
                    if s.slot >= 0:
                        self.free.append(s.slot)
                        s.slot = -1
                self.active.clear()
            try:
                for fut, exc, s in results:
                    self._loop.call_soon_threadsafe(self._deliver, fut, exc, s)
            except RuntimeError:  # the event loop is gone (process exiting without close()): nobody waits
                return

    def _admissible(self) -> bool:
        """A waiting sequence could start now (under _cv): a decode row is free and it is a
        continuation (it brings its KV row) or a KV row is free."""
        return len(self.active) < self.slots and any(not s.fresh or self.free for s in self.waiting)

    def _take_admits(self) -> list[_Seq]:
        # at most `slots` sequences decode; continuations of kept sequences bring their own KV row
        # and go first (their episode is mid-way), new ones take free KV rows in order
        room = self.slots - len(self.active)
        conts = [s for s in self.waiting if not s.fresh]
        rest = [s for s in self.waiting if s.fresh]
        admits = conts[: max(room, 0)]
        n = max(0, min(len(self.free), len(rest), room - len(admits)))
        self.waiting = conts[len(admits) :] + rest[n:]
        for s in rest[:n]:
            s.slot = self.free.pop()
        return admits + rest[:n]

    def _run_updates(self, pending) -> bool:
        """Apply queued updates in order; True when the weights changed."""
        before = (self.version, self.epoch)
        for fn, fut in pending:
            try:
                fn()
            except BaseException as e:  # the submitter gets the reason
                fut.get_loop().call_soon_threadsafe(_settle, fut, e, None)
            else:
                fut.get_loop().call_soon_threadsafe(_settle, fut, None, None)
        return (self.version, self.epoch) != before

    @torch.no_grad()
    def _turn(self, pending, admits: list[_Seq]) -> list[_Seq]:
        """One token boundary (runs in a worker thread): updates, admissions, one decode step."""
        t0 = time.perf_counter()
        if pending and self._run_updates(pending):
            self._stall_from = (self._prep_s, time.perf_counter() - t0, self._last_step_end)
        finished: list[_Seq] = []
        if admits:  # prefill: the first completion token comes from the prompt's logits
            for s in admits:
                if s.fresh:
                    self.cache.reset(s.slot)
                self.active[s.slot] = s
            logits = self.model.prefill_many([s.feed for s in admits], self.cache, [s.slot for s in admits])
            self._emit(admits, logits, finished)
        # in slot order: when every slot is busy the KV cache is read as views, not gathered
        live = sorted(
            (s for s in self.active.values() if not s.finish and s not in admits), key=lambda s: s.slot
        )
        end = None
        if live:
            t1 = time.perf_counter()
            tokens = torch.tensor([s.tokens[-1] for s in live], dtype=torch.long)
            slots = torch.tensor([s.slot for s in live], dtype=torch.long)
            logits = self.model.decode(tokens, self.cache, slots)
            self._emit(live, logits, finished)
            end = time.perf_counter()
            gap = (
                end - self._last_step_end
                if self._last_step_end is not None and self._stall_from is None
                else None
            )
            self.metrics.step(
                end - t1,
                len(live) + len(admits),
                gap,  # sequences that got a token this turn
                preparing=self._preparing,
            )
            self._last_step_end = end
        else:
            self.metrics.tokens += len(admits)
        if self._stall_from is not None and (live or not self.active):
            prep_s, swap_s, prev_end = self._stall_from  # stall: gap between the decode steps around it
            self.metrics.update(
                prep_s,
                end - prev_end if end is not None and prev_end is not None else None,
                boundary_s=swap_s,
            )
            self._stall_from = None
        with self._cv:  # release() decides under the same lock whether a slot is kept
            for s in finished:
                del self.active[s.slot]
                if s.keep and self.kept.get(s.handle) is s:
                    self.kept[s.handle] = s  # not released meanwhile: the slot stays with the episode
                    s.parked = True
                    continue
                self.free.append(s.slot)
                s.slot = -1
        return finished

    def _emit(self, seqs: list[_Seq], logits: torch.Tensor, finished: list[_Seq]) -> None:
        """Sample one token per sequence (each row with its own sampling config) and append it."""
        out = policy.sample(logits, [s.cfg for s in seqs], self.generator)
        toks, lps = out.tokens.tolist(), out.logprobs.tolist()
        rows = out.mask.row_parts()
        for j, s in enumerate(seqs):
            s.tokens.append(toks[j])
            s.logprobs.append(lps[j])
            s.versions.append(self.version)
            s.mask_rows.append(rows[j])
            s.epoch = self.epoch
            if toks[j] in s.stop:
                s.finish = "stop"
            elif s.stop_seqs and any(
                len(s.tokens) >= len(q) and tuple(s.tokens[-len(q) :]) == q for q in s.stop_seqs
            ):
                s.finish = "stop_seq"
            elif len(s.tokens) >= s.sampling.max_tokens:
                s.finish = "length"
            if s.finish:
                finished.append(s)

    def _deliver(self, fut: asyncio.Future, exc, s: _Seq | None) -> None:
        res = None
        if exc is None and not fut.done():
            try:
                res = self._result(s)
            except Exception as e:  # the caller gets the reason, not a future that never resolves
                exc = e
        _settle(fut, exc, res)

    def _result(self, s: _Seq) -> Generation:
        return Generation(
            completion_ids=s.tokens,
            logprobs=s.logprobs,
            token_versions=s.versions,
            sampling_mask=policy.SamplingMask.from_rows(s.mask_rows).to_wire(),
            finish_reason=s.finish,
            wall_s=time.perf_counter() - s.started,
            epoch=s.epoch,
            quant=self.quant.to_wire(),
            handle=s.handle,
        )


def column_major(model: torch.nn.Module) -> None:
    """Every matrix the decode step multiplies (x @ W.T) stored as W.T contiguous, in place: on a CPU
    a decode step is a skinny matmul (one row per sequence), and against a contiguous W.T it is
    ~1.5x faster at 16 rows (SmolLM2's MLP, one thread: 534 -> 267 us; docs/benchmarks.md#peer).
    The parameters keep their shapes; updates copy into buffers made with empty_like, which keeps
    the layout, so every later version stays column-major too."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.data = p.data.t().contiguous().t()


def _settle(fut: asyncio.Future, exc, res) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)
