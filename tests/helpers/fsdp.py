"""FSDP trainer test helpers: packed samples, a trainer config dict, and a torchrun launch of
tests/fsdp_worker.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from trainer.learner import PackedSample

ROOT = Path(__file__).resolve().parents[2]


def make_samples(n: int = 7, seed: int = 0) -> list[PackedSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.choice([2, 5, 30])
        out.append(
            PackedSample(
                str(i),
                i // 3,
                rng.random(),
                1.0,
                0,
                [1, 2, 3 + i // 3],  # a prompt per group: packed units (policy/packing.py) spread over ranks
                [rng.randrange(4, 40) for _ in range(k)],
                [-1.5 - 0.1 * j for j in range(k)],
                {"temperature": 1.0, "top_p": 0.9},
                {},
                {},
            )
        )
    return out


def cfg_dict(tmp_path: Path, **over) -> dict:
    """A TrainerConfig as a dict of sections; a section in `over` is merged key by key."""
    d = {
        "policy": {"model": {"preset": "tiny"}, "activation_checkpointing": True, "device": "cpu"},
        "optim": {"lr": 1e-3, "warmup_steps": 3, "grad_clip": 1.0},
        "loss": {"micro_batch": 2, "kl_coef": 0.1},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "trainer_id": "t",
    }
    return {**d, **{k: {**d[k], **v} if isinstance(d.get(k), dict) else v for k, v in over.items()}}


def launch(args: list[str], nproc: int = 2, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node N ARGS` from the repository root: the one way the
    tests start a rank group. One intra-op thread per rank unless OMP_NUM_THREADS says otherwise
    (make test-numeric runs 1 and 2). Its own session: a hung group is killed whole on timeout
    (torchrun's workers included), then the timeout is raised."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    p = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def torchrun(tmp_path: Path, spec: dict, nproc: int = 2, timeout_s: float = 240, ok: bool = True) -> dict:
    """tests/fsdp_worker.py under torchrun with `spec`; its rank 0's result."""
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    r = launch(
        [str(ROOT / "tests" / "fsdp_worker.py"), str(tmp_path / "spec.json"), str(out)], nproc, timeout_s
    )
    if not ok:
        assert r.returncode != 0
        return {}
    assert r.returncode == 0, r.stderr.decode()[-4000:]
    return torch.load(out / "result.pt", weights_only=False)
