"""Reading a sharded (DCP) checkpoint without running code from it.

torch.distributed.checkpoint's FileSystemReader unpickles the folder's `.metadata` with plain
`pickle.load` (its tensor files already load with weights_only=True), so a shard folder planted
next to the checkpoints would be code execution in the trainer. `SafeReader` reads the metadata
with an unpickler that resolves only what DCP's metadata is made of: classes from
torch.distributed.checkpoint, torch.Size, dtypes / layouts / memory formats, paths. Anything else
(os.system, builtins.getattr, ...) is refused with `UnsafeMetadata` before it can be called.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


class UnsafeMetadata(pickle.UnpicklingError):
    pass


_PATHS = {("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
_CALLABLES = {("torch.serialization", "_get_layout"), ("torch", "Size")}  # name -> layout; a shape tuple
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PATHS or (module, name) in _CALLABLES:
            return super().find_class(module, name)
        if module == "torch":  # torch.float32 & co. are values, never callables
            obj = getattr(torch, name, None)
            if isinstance(obj, _TORCH_VALUES):
                return obj
        elif module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # its dataclasses and enums; none of its functions
                return obj
        raise UnsafeMetadata(
            f"checkpoint metadata refers to {module}.{name}: not part of DCP metadata "
            f"(refused, nothing was run)"
        )


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read by `_MetadataUnpickler` (see the module doc)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeMetadata(f"{path} does not hold DCP metadata (a {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
