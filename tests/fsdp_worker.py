"""Run under torchrun by tests/test_trainer_fsdp.py: FSDP2 learner steps, sharded checkpoints,
sharded publication parts. Not collected by pytest (no test_ prefix)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import torch

from trainer.commands import world
from trainer.config import TrainerConfig
from trainer.dist import (
    end_rank_process,
    follower_loop,
    init_distributed,
    shutdown_distributed,
    stop_followers,
)
from trainer.factory import build_learner, build_model, build_optimizer


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    init_distributed()
    rank, ws = world()
    cfg = TrainerConfig(**spec["cfg"])
    model, mcfg = build_model(cfg)
    opt = build_optimizer(model, cfg)
    learner = build_learner(model, opt, cfg)
    if rank > 0:  # the followers replay rank 0's commands, as in `python -m trainer`
        asyncio.run(follower_loop(learner))
        shutdown_distributed()
        return
    if spec.get("prepare"):  # the leader's start: resume, warm start, first checkpoint
        from trainer.leader import Trainer

        tr = Trainer(cfg, None, learner, mcfg)
        tr.prepare()
        fp32 = learner.publication.full_fp32()
        stop_followers(learner)
        torch.save({"fp32": fp32, "digest": tr.digest, "version": tr.version}, out / "result.pt")
        shutdown_distributed()
        return
    if spec.get("async_kill"):  # an async save of v2 in flight when rank 0 dies
        import os
        import signal

        from trainer import checkpoint
        from trainer.leader import Trainer

        samples = torch.load(spec["samples"], weights_only=False)
        tr = Trainer(cfg, None, learner, mcfg)
        tr.lease.epoch = 1
        learner.step(samples)
        tr.version = 1
        tr.save()  # waits for the background save, then names it
        ref = checkpoint.load_latest(cfg.checkpoint.dir).model["__dcp__"]
        torch.save(
            {
                "fp32": learner.publication.full_fp32(),
                "complete": (Path(cfg.checkpoint.dir) / ref / ".metadata").is_file(),
            },
            out / "v1.pt",
        )
        learner.step(samples)
        tr.version = 2
        tr.state()  # starts the v2 save in the background ...
        (out / "v2-started").write_text(repr(learner.checkpoint.pending))
        os.kill(os.getpid(), signal.SIGKILL)  # ... and dies before it could name it
    samples = torch.load(spec["samples"], weights_only=False)
    if spec.get("resume"):
        ref = torch.load(spec["resume"], weights_only=False)
        learner.checkpoint.load(spec["ckpt_dir"], ref["model"], ref["optimizer"])
    stats = []
    learner.publication.mark_published()
    for _ in range(spec.get("steps", 1)):
        stats.append(learner.step(samples))
    payload = (
        learner.checkpoint.payload(spec["ckpt_dir"], 1, spec.get("version", 1)) if spec.get("save") else None
    )
    state = learner.publication.published_state()
    extra = {}
    if spec.get("parts"):  # sharded publication: every rank encodes the rows it owns
        extra["parts"] = learner.publication.publish_parts(0, 1)
    fp32 = learner.publication.full_fp32()
    stop_followers(learner)
    torch.save({"state": state, "stats": stats, "payload": payload, "fp32": fp32, **extra}, out / "result.pt")
    shutdown_distributed()


if __name__ == "__main__":
    main()
    end_rank_process(0)  # every clean path left the group; a failure raised before this
