"""Run by torchrun's elastic agents in tests/test_trainer_elastic.py: a sharded (FSDP2) group that
steps on a fixed batch and commits a checkpoint per version (DCP shards, then the checkpoint file);
a re-formed group resumes from the newest complete one, as the trainer does. Not collected by
pytest (no test_ prefix)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import torch

from trainer import checkpoint
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
    out = Path(spec["out"])
    init_distributed()
    rank, ws = world()
    cfg = TrainerConfig(**spec["cfg"])
    model, _ = build_model(cfg)
    learner = build_learner(model, build_optimizer(model, cfg), cfg)
    if rank > 0:
        asyncio.run(follower_loop(learner))
        shutdown_distributed()
        return
    st = checkpoint.load_latest(cfg.checkpoint.dir)
    version, epoch = (st.version, st.epoch + 1) if st else (0, 1)  # one epoch per group formation
    if st is not None:
        learner.checkpoint.load(cfg.checkpoint.dir, st.model, st.optimizer)
    samples = torch.load(spec["samples"], weights_only=False)
    while version < spec["target"]:
        learner.step(samples)
        version += 1
        payload = learner.checkpoint.payload(cfg.checkpoint.dir, epoch, version)
        learner.checkpoint.wait()
        checkpoint.save(cfg.checkpoint.dir, checkpoint.TrainerState(version=version, epoch=epoch, **payload))
        with open(out / "versions.txt", "a") as f:
            f.write(json.dumps({"version": version, "epoch": epoch, "world": ws, "pid": os.getpid()}) + "\n")
        time.sleep(spec.get("pause_s", 0.0))
    stop_followers(learner)
    shutdown_distributed()


if __name__ == "__main__":
    main()
    end_rank_process(0)  # every clean path left the group; a failure raised before this
