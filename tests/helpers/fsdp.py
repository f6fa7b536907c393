"""FSDP trainer test helpers: packed samples, a trainer config dict, and a torchrun launch of
tests/fsdp_worker.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings
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
                [1, 2, 3],
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


TEARDOWN_ABORT = b"terminate called without an active exception"


def _run_group(tmp_path: Path, out: Path, nproc: int, env: dict, timeout_s: float) -> tuple[int, bytes]:
    # a session of its own: a hung group is killed whole on timeout (torchrun's workers included)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(ROOT / "tests" / "fsdp_worker.py"),
            str(tmp_path / "spec.json"),
            str(out),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        raise
    return p.returncode, err


def torchrun(tmp_path: Path, spec: dict, nproc: int = 2, timeout_s: float = 240, ok: bool = True) -> dict:
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    # one intra-op thread per rank unless OMP_NUM_THREADS says otherwise (make test-numeric runs 1 and 2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for attempt in (1, 2):
        rc, err = _run_group(tmp_path, out, nproc, env, timeout_s)
        # a gloo rank aborting in its C++ teardown ("terminate called without an active exception",
        # trainer/dist.shutdown_distributed) was seen once in ~13 runs of this file: one retry of
        # the whole group, only for that signature (the results are asserted as ever)
        if rc == 0 or not ok or TEARDOWN_ABORT not in err or attempt == 2:
            break
        warnings.warn(
            f"torchrun group aborted in teardown, retried once:\n{err.decode()[-1500:]}", stacklevel=2
        )
    if not ok:
        assert rc != 0
        return {}
    assert rc == 0, err.decode()[-4000:]
    return torch.load(out / "result.pt", weights_only=False)
