"""The model and optimizer part of a trainer checkpoint, on every rank, and its collectives.

One process: the state dicts themselves (the single-file format of trainer/checkpoint.py). A
sharded group: every rank writes and reads its own shards with torch.distributed.checkpoint
(trainer/shards.py), which are collectives, so rank 0 issues them as `SaveShards` / `LoadShards`
(trainer/commands.py) and every rank runs the same one. With `async_save` a rank's write finishes
in the background; `wait()` blocks until it has, and nothing may name the folder before."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path

from .commands import Collective, collective
from .fsdp import is_sharded


class CheckpointState:
    """This rank's model and optimizer as checkpoint payload, and its background saves in flight."""

    def __init__(self, model, opt, async_save: bool = False):
        self.model, self.opt, self.async_save = model, opt, async_save
        self.pending: list = []  # this rank's background saves in flight, oldest first
        self._lock = threading.Lock()

    def payload(self, ckpt_dir: str | Path, epoch: int, version: int) -> dict:
        """The model and optimizer part of a trainer checkpoint. One process: the state dicts
        (single-file format). Sharded: every rank writes its shards with torch.distributed.checkpoint
        into a folder named after (epoch, version) and the checkpoint file records that name."""
        if not is_sharded(self.model):
            return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        return collective(SaveShards(ckpt_dir, epoch, version), self)

    def wait(self) -> None:
        """Block until this rank's background shard save (async_save) is complete; raises its
        error. The trainer checkpoint file that names the folder is written only after this (on
        rank 0, whose save completes last: it writes `.metadata` once every rank wrote)."""
        # the leader's publication of v-1 and the step of v may both wait (two threads): saves
        # complete in order, so waiting for every pending one is never early for either
        while self.pending:
            f = self.pending[0]
            f.result()
            with self._lock:
                if self.pending and self.pending[0] is f:
                    self.pending.pop(0)

    def load(self, ckpt_dir: str | Path, model_state: dict | None, opt_state: dict | None) -> None:
        """Inverse of payload, whatever world size wrote it (collective when sharded; the other
        ranks get only the shard folder's reference: rank 0 alone read the checkpoint file)."""
        collective(LoadShards(ckpt_dir, model_state, opt_state), self)


@dataclass(frozen=True)
class SaveShards(Collective[dict], on=CheckpointState):
    """Every rank writes its shards of (epoch, version); -> the reference the checkpoint file keeps."""

    ckpt_dir: str | Path
    epoch: int
    version: int

    def run(self, ckpt: CheckpointState) -> dict:
        from .shards import save_shards  # torch.distributed.checkpoint: imported when first needed

        ckpt.wait()  # one background save at a time (and its staging memory)
        ref, pending = save_shards(
            ckpt.model, ckpt.opt, self.ckpt_dir, self.epoch, self.version, async_save=ckpt.async_save
        )
        if pending is not None:
            ckpt.pending.append(pending)
        return {"model": ref, "optimizer": {}}


@dataclass(frozen=True)
class LoadShards(Collective[None], on=CheckpointState):
    """Every rank loads a checkpoint payload: a shard folder each reads its part of (DCP reshards),
    or a single-file state rank 0 read, sent to the others by set_*_state_dict."""

    ckpt_dir: str | Path
    model_state: dict | None
    opt_state: dict | None

    def wire(self) -> LoadShards:
        # only a shard folder's reference travels; whole state dicts stay on rank 0
        ref = self.model_state if self.model_state and "__dcp__" in self.model_state else None
        return replace(self, model_state=ref, opt_state=None)

    def run(self, ckpt: CheckpointState) -> None:
        from .shards import load_any

        load_any(ckpt.model, ckpt.opt, self.ckpt_dir, self.model_state, self.opt_state)
