"""Atomic trainer checkpoints: tmp file + fsync + rename + directory fsync.

One file per (epoch, version) (`ckpt-e00000007-v00000012.pt`). A sharded (FSDP2) run writes its
model and optimizer with torch.distributed.checkpoint (trainer/shards.py) and the file names that
folder instead of holding the state dicts; the file stays the commit point. Resume takes the readable one
with the highest epoch, then the highest version: a deposed leader that still managed to write
a checkpoint after a takeover (lower epoch) can never be resumed over the new leader's line,
and a crash mid-write (a tmp file) never hides the previous good checkpoint.

Loading never runs code: `torch.load(weights_only=True)` takes tensors and plain containers only, so
a pickle planted as `ckpt-*.pt` (the directory is writable by any process of the same user) is
refused as unreadable, not executed. `load_latest(verify=...)` also refuses a well-formed checkpoint
that is not the run's own (trainer/digest_chain.py) and falls back to the previous one.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernel import get_logger

log = get_logger(__name__)

NAME = re.compile(r"^ckpt-e(\d{8})-v(\d{8})\.pt$")


class CheckpointError(RuntimeError):
    pass


@dataclass
class TrainerState:
    version: int
    epoch: int
    model: dict  # fp32 master state_dict, or {"__dcp__": shard folder name}
    optimizer: dict
    consumed: list[str] = field(default_factory=list)  # rollout ids used or dropped, oldest first
    digest: str = ""  # delta_codec.state_digest of the published bf16 weights at `version`
    model_config: dict = field(default_factory=dict)
    step: int = 0
    warmstarted: bool = False


def _cpu_copy(x, into=None):
    """Every tensor copied to CPU memory of its own (never a view of the original: `.to("cpu")` of a
    CPU tensor would return the tensor itself), containers rebuilt, anything else deep-copied.
    `into`: an earlier copy of the same structure nobody reads any more; its tensors of the same
    shape and dtype are overwritten in place (a GB-sized state: no fresh pages to fault in)."""
    if isinstance(x, torch.Tensor):
        if (
            isinstance(into, torch.Tensor)
            and into.device.type == "cpu"
            and into.shape == x.shape
            and into.dtype == x.dtype
            and into.is_contiguous()
        ):
            return into.copy_(x.detach())
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        prev = into if isinstance(into, dict) else {}
        return {k: _cpu_copy(v, prev.get(k)) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        prev = into if type(into) is type(x) and len(into) == len(x) else [None] * len(x)
        return type(x)(_cpu_copy(v, p) for v, p in zip(x, prev))
    return copy.deepcopy(x)


def snapshot(st: TrainerState, reuse: TrainerState | None = None) -> TrainerState:
    """A CPU copy that later in-place updates of the live model and optimizer cannot touch, so the
    checkpoint can be written (in the background: trainer/checkpoint_writer.py) while the next step
    already runs. `reuse`: an earlier snapshot whose write has completed (the background writer is
    idle whenever a snapshot is due): its buffers are overwritten instead of allocating new ones."""
    return TrainerState(
        **{
            **st.__dict__,
            "model": _cpu_copy(st.model, reuse.model if reuse else None),
            "optimizer": _cpu_copy(st.optimizer, reuse.optimizer if reuse else None),
            "consumed": list(st.consumed),
            "model_config": copy.deepcopy(st.model_config),
        }
    )


def path_for(ckpt_dir: str | Path, epoch: int, version: int) -> Path:
    return Path(ckpt_dir) / f"ckpt-e{epoch:08d}-v{version:08d}.pt"


def save(ckpt_dir: str | Path, st: TrainerState, keep: int = 3, commit_if=None) -> Path:
    """`commit_if()` (a background write: the writer's lease still held) is asked once the data is
    durable, just before the rename that commits it; False: the tmp file is removed, nothing lands."""
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = path_for(d, st.epoch, st.version)
    tmp = final.with_suffix(f".tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(st.__dict__, f)
        f.flush()
        os.fsync(f.fileno())
    if commit_if is not None and not commit_if():
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"checkpoint v{st.version} e{st.epoch} not committed: no longer leading")
    os.replace(tmp, final)
    fd = os.open(d, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in list_checkpoints(d)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    if keep > 0:
        _prune_shard_folders(d)
    return final


def _prune_shard_folders(d: Path) -> None:
    """Shard folders older than the oldest kept checkpoint that no kept checkpoint names."""
    from .shards import SHARDS, prune_shards

    if not any(SHARDS.match(p.name) for p in d.iterdir()):
        return  # single-file checkpoints: reading back every kept one (GBs each) would find nothing
    kept = list_checkpoints(d)
    if not kept:
        return
    oldest = tuple(int(x) for x in NAME.match(kept[0].name).groups())
    referenced = set()
    for p in kept:
        try:
            ref = torch.load(p, map_location="cpu", weights_only=True).get("model", {})
        except Exception:  # unreadable: it names nothing we can keep for it
            continue
        if isinstance(ref, dict) and isinstance(ref.get("__dcp__"), str):
            referenced.add(ref["__dcp__"])
    if referenced:  # only sharded runs write shard folders
        prune_shards(d, oldest, referenced)


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if NAME.match(p.name)]
    return sorted(found, key=lambda p: tuple(int(x) for x in NAME.match(p.name).groups()))


def load(path: str | Path) -> TrainerState:
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
        return TrainerState(**raw)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {e}") from e


def load_latest(ckpt_dir: str | Path, verify=None) -> TrainerState | None:
    """Newest readable checkpoint, or None when there is none; unreadable ones are skipped, and so
    are those `verify(state)` refuses (it raises CheckpointError: e.g. DigestChain.check)."""
    errors = []
    for p in reversed(list_checkpoints(ckpt_dir)):
        try:
            st = load(p)
            if verify is not None:
                verify(st)
            return st
        except CheckpointError as e:
            log.warning("skipping a checkpoint (unreadable or not this run's)", error=str(e))
            errors.append(str(e))
    if errors:
        raise CheckpointError("no readable checkpoint: " + "; ".join(errors))
    return None
