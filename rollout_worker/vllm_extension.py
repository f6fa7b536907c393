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
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

BACKEND = "asyncrl_delta"
EXTENSION = "rollout_worker.vllm_extension.DeltaWorkerExtension"


# -- tensors over vLLM's RPC (its msgpack carries bytes, not tensors, in untyped arguments) --
def pack_tensor(name: str, t: torch.Tensor) -> list:
    t = t.detach().contiguous().cpu()
    return [name, str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()]


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
    tensors: list = field(default_factory=list)    # [[hf_name, dtype, shape, bytes], ...], whole layers


class DeltaTransferEngine(WeightTransferEngine[DeltaInitInfo, DeltaUpdateInfo]):
    """Loads whole layers in place: layerwise reload of just the touched modules, so their kernel
    processing (fused q/k/v, packed CPU GEMM weights) is redone and every other layer is left alone."""
    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        pass                           # payloads ride the RPC itself: nothing to connect

    def start_weight_update(self) -> None:
        pass                           # each update_weights call is a complete set of layers

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():          # GPU copies are async; CPU ones are done
            torch.accelerator.synchronize()

    def receive_weights(self, info: DeltaUpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)
        weights = [unpack_tensor(r) for r in info.tensors]
        modules = self._modules_for([n for n, _ in weights])   # validates before touching anything
        for m in modules:
            initialize_layerwise_reload(m)
        self.model.load_weights(iter(weights))
        for m in modules:
            finalize_layerwise_reload(m, self.model_config)

    def _modules_for(self, names: list[str]) -> list[torch.nn.Module]:
        packed = getattr(self.model, "packed_modules_mapping", {}) or {}
        mods = []
        for key, members in layer_groups(names, packed).items():
            try:
                mod = self.model.get_submodule(key)
            except AttributeError:
                raise ValueError(f"no module {key!r} in the vLLM model for tensors {members[:3]}") from None
            parts = packed.get(key.rpartition(".")[2], [key.rpartition(".")[2]])
            parent = key.rpartition(".")[0]
            expect = {f"{parent}.{p}.{pn}" if parent else f"{p}.{pn}"
                      for p in parts for pn, _ in mod.named_parameters(recurse=False)}
            if set(members) != expect:
                raise ValueError(f"layer {key} needs exactly {sorted(expect)}, got {sorted(members)}")
            mods.append(mod)
        return mods

    def shutdown(self) -> None:
        pass


try:
    WeightTransferEngineFactory.register_engine(BACKEND, DeltaTransferEngine)
except ValueError:                     # module imported twice in one process
    pass


class DeltaWorkerExtension:
    """Mixed into vLLM's worker (worker_extension_cls): importing this module in the worker
    process registers the backend above; the methods are reachable via collective_rpc."""

    def asyncrl_packed_modules(self) -> dict[str, list[str]]:
        model = self.model_runner.get_model()
        return {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", {}) or {}).items()}
