"""Sharded trainer checkpoints with torch.distributed.checkpoint (DCP).

Every rank writes the shards it owns of the model and the optimizer into one folder per
(epoch, version), `shards-e00000007-v00000012/`; DCP writes its `.metadata` last, on the
coordinator, so a folder without it is an interrupted write. The trainer checkpoint file
(trainer/checkpoint.py) records the folder's name in place of the state dicts and stays the
atomic commit point: a folder no checkpoint file names is garbage, pruned with old checkpoints.

The state dicts are the FQN-keyed ones of torch.distributed.checkpoint.state_dict, the same for a
sharded and an unsharded model, so a checkpoint written by N ranks loads on M ranks (DCP reshards),
on one process without a process group, and a single-file (world 1) checkpoint loads into a
sharded model (rank 0's copy, broadcast)."""

from __future__ import annotations

import re
import shutil
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from .commands import world
from .safe_dcp import SafeReader

SHARDS = re.compile(r"^shards-e(\d{8})-v(\d{8})$")


def shards_name(epoch: int, version: int) -> str:
    return f"shards-e{epoch:08d}-v{version:08d}"


_CKPT_GROUP = None


def _checkpoint_group():
    """A gloo group of its own for background saves: their collectives run in DCP's thread while
    the training thread issues its own on the default group, and two threads must never share
    one group's collective order. Created on the first async save (all ranks get there together)."""
    global _CKPT_GROUP
    if _CKPT_GROUP is None and world()[1] > 1:
        _CKPT_GROUP = dist.new_group(backend="gloo")
    return _CKPT_GROUP


def save_shards(
    model, opt, ckpt_dir: str | Path, epoch: int, version: int, async_save: bool = False
) -> tuple[dict, Future | None]:
    """Collective: all ranks write their shards. Returns the reference the checkpoint file keeps
    and, with async_save, the future of the write: the shards are staged (copied) before this
    returns, so the next step may change the weights at once, but the folder is complete (its
    `.metadata` written) only once the future is done; nothing may name it before that."""
    name = shards_name(epoch, version)
    path = Path(ckpt_dir) / name
    if world()[0] == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a leftover of an interrupted write of the same version
            shutil.rmtree(path)
    if world()[1] > 1:
        dist.barrier()
    # an optimizer that has not stepped has no state; asking for its state dict would create it
    # with a zero-lr step that counts as a step (AdamW's bias correction would be off after)
    has_optim = any(opt.state.values())  # the same on every rank: they step together
    msd, osd = get_state_dict(model, opt) if has_optim else (get_model_state_dict(model), None)
    sd = {"model": msd, **({"optim": osd} if has_optim else {})}
    ref = {"__dcp__": name, "optim": has_optim}
    if async_save and hasattr(dcp, "async_save"):
        res = dcp.async_save(sd, checkpoint_id=str(path), process_group=_checkpoint_group())
        return ref, getattr(res, "upload_completion", res)  # an AsyncSaveResponse or a Future
    dcp.save(sd, checkpoint_id=str(path))
    return ref, None


def load_any(model, opt, ckpt_dir: str | Path, model_state: dict | None, opt_state: dict | None) -> None:
    """Load a checkpoint payload of either format into `model`/`opt`, sharded or not."""
    rank, ws = world()
    if model_state is not None and "__dcp__" in model_state:
        path = Path(ckpt_dir) / model_state["__dcp__"]
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"sharded checkpoint {path} is incomplete (no .metadata)")
        if model_state.get("optim", True):
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            # without a process group: one process reads every shard; SafeReader: metadata runs no code
            dcp.load(sd, checkpoint_id=str(path), storage_reader=SafeReader(path))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:  # saved before the first step: a fresh optimizer
            sd = {"model": get_model_state_dict(model)}
            dcp.load(sd, checkpoint_id=str(path), storage_reader=SafeReader(path))
            set_model_state_dict(model, sd["model"])
        return
    if ws == 1:
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
        return
    # a single-file checkpoint (rank 0 read it) into a sharded model: rank 0's full state, broadcast
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_state if rank == 0 else {}, options=opts)
    full_osd = _fqn_optimizer_state(model, opt_state) if rank == 0 else {}
    set_optimizer_state_dict(model, opt, full_osd, options=opts)


def load_model_state(model, ckpt_dir: str | Path, model_state: dict) -> None:
    """A checkpoint's model weights, whole or sharded, into an unsharded `model` in one process
    without a process group (the final eval, `asyncrl export`): DCP reads every rank's shards."""
    if "__dcp__" not in model_state:
        model.load_state_dict(model_state)
        return
    path = Path(ckpt_dir) / model_state["__dcp__"]
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"sharded checkpoint {path} is incomplete (no .metadata)")
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=str(path), storage_reader=SafeReader(path))  # only the model's keys
    set_model_state_dict(model, sd["model"])


def _fqn_optimizer_state(model, osd: dict) -> dict:
    """torch.optim's id-keyed state dict -> the FQN-keyed one (one param group per model here)."""
    names = [n for n, _ in model.named_parameters()]
    state = {names[i]: v for i, v in osd["state"].items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
        for g in osd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def prune_shards(ckpt_dir: str | Path, keep_from: tuple[int, int] | None, referenced: set[str]) -> None:
    """Remove shard folders older than the oldest kept checkpoint that no checkpoint names."""
    d = Path(ckpt_dir)
    if keep_from is None or not d.is_dir():
        return
    for p in d.iterdir():
        m = SHARDS.match(p.name)
        if m and p.name not in referenced and (int(m[1]), int(m[2])) < keep_from:
            shutil.rmtree(p, ignore_errors=True)
