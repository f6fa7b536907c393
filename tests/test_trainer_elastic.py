"""The elastic launch path (trainer/elastic.py, `python -m trainer --elastic`): the torchrun line
built from the config, the agent's environment, bad settings refused before anything starts.
The swap itself runs end to end in tests/test_chaos_rank_kill.py (chaos-marked: minutes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import TrainerConfig
from trainer.elastic import agent_env, torchrun_argv

ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_line_from_config():
    cfg = TrainerConfig(
        trainer_id="g",
        elastic={
            "nnodes": "2:3",
            "nproc_per_node": 8,
            "rdzv_endpoint": "head:29500",
            "rdzv_id": "run7",
            "max_restarts": 5,
            "rdzv_host": True,
            "rdzv_conf": "join_timeout=120",
        },
    )
    argv = torchrun_argv(cfg, ["--config", "t.toml"], python="py")
    assert argv[:3] == ["py", "-m", "torch.distributed.run"]
    for flag in (
        "--nnodes=2:3",
        "--nproc_per_node=8",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=head:29500",
        "--rdzv_id=run7",
        "--max_restarts=5",
        "--rdzv_conf=is_host=1,join_timeout=120",
    ):
        assert flag in argv, flag
    assert argv[-4:] == ["-m", "trainer", "--config", "t.toml"]  # the ranks run the plain trainer
    assert "--rdzv_conf=is_host=0" in torchrun_argv(TrainerConfig(trainer_id="g"), [])
    # without this a spare that joins as rank > 0 waits forever for the workers' store
    assert agent_env({"A": "1"}) == {"A": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.mark.parametrize(
    "bad",
    [
        {"nnodes": "3:2"},
        {"nnodes": "0:2"},
        {"nnodes": "two"},
        {"nnodes": "1:2:3"},
        {"nproc_per_node": 0},
        {"max_restarts": -1},
        {"rdzv_endpoint": "nohostport"},
    ],
)
def test_bad_elastic_settings_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        TrainerConfig(trainer_id="g", elastic=bad)


def test_elastic_flag_with_bad_config_fails_clearly_before_torchrun(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text('[trainer]\ntrainer_id = "g"\n[trainer.elastic]\nnnodes = "3:2"\n')
    r = subprocess.run(
        [sys.executable, "-m", "trainer", "--elastic", "--config", str(cfg)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "[trainer.elastic] nnodes: must be N or MIN" in r.stderr, r.stderr[-2000:]
    assert "torch.distributed.run" not in r.stderr


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


@pytest.mark.chaos
def test_spare_node_swap_resumes_the_sharded_line(tmp_path):
    """Three elastic agents (nnodes 2:2: two nodes and a spare) run a sharded group that commits a
    DCP checkpoint per version. SIGKILL a node (agent and rank) that does not host the store: the
    group re-forms with the spare at world 2 and resumes from the newest complete checkpoint;
    every version is committed once, and the final weights are those of an uninterrupted run."""
    import json
    import signal
    import time

    import torch

    from tests.test_trainer_fsdp import assert_runs_close, cfg_dict, make_samples, one_process
    from trainer import checkpoint
    from trainer.factory import build_learner, build_model, build_optimizer

    samples = make_samples(seed=3)
    torch.save(samples, tmp_path / "samples.pt")
    cfg = cfg_dict(tmp_path, loss={"kl_coef": 0.0}, policy={"activation_checkpointing": False})
    target = 8
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "spec.json").write_text(
        json.dumps(
            {
                "cfg": cfg,
                "samples": str(tmp_path / "samples.pt"),
                "out": str(out),
                "target": target,
                "pause_s": 0.5,
            }
        )
    )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = []
    env = agent_env({**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        for i in range(3):
            c = TrainerConfig(
                trainer_id="g",
                elastic={
                    "nnodes": "2:2",
                    "rdzv_endpoint": f"127.0.0.1:{port}",
                    "rdzv_id": f"t{port}",
                    "max_restarts": 3,
                    "rdzv_host": i == 0,
                    "rdzv_conf": "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,"
                    "keep_alive_max_attempt=3",
                },
            )
            argv = torchrun_argv(c, [])[:-2] + [
                str(ROOT / "tests" / "elastic_worker.py"),
                str(tmp_path / "spec.json"),
            ]
            log = open(tmp_path / f"node{i}.log", "wb")
            agents.append(
                subprocess.Popen(
                    argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            time.sleep(0.5 if i == 0 else 0)
        lines = lambda: (
            [json.loads(x) for x in (out / "versions.txt").read_text().splitlines()]
            if (out / "versions.txt").exists()
            else []
        )  # noqa: E731
        t0 = time.monotonic()
        while len(lines()) < 2:
            assert time.monotonic() - t0 < 180, [
                (tmp_path / f"node{i}.log").read_text()[-1500:] for i in range(3)
            ]
            time.sleep(0.2)
        members = [i for i in range(3) if _children(agents[i].pid)]
        spare = ({0, 1, 2} - set(members)).pop()
        victim = next(i for i in members if i != 0)  # node 0 hosts the rendezvous store
        rank_pid = _children(agents[victim].pid)[0]
        agents[victim].kill()
        os.kill(rank_pid, signal.SIGKILL)
        killed_at = len(lines())
        spare_joined = False
        while not any(a.poll() is not None and a.returncode == 0 for a in agents):
            spare_joined |= bool(_children(agents[spare].pid))
            assert time.monotonic() - t0 < 240, [
                (tmp_path / f"node{i}.log").read_text()[-1500:] for i in range(3)
            ]
            time.sleep(0.5)
    finally:
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)
        for a in agents:
            try:
                a.wait(timeout=30)
            except subprocess.TimeoutExpired:
                a.kill()
    got = lines()
    versions = [d["version"] for d in got]
    assert versions == sorted(set(versions)) and versions[-1] == target, got  # committed once each, in order
    assert len({d["epoch"] for d in got}) == 2 and all(d["world"] == 2 for d in got), (
        got
    )  # re-formed at world 2
    assert killed_at < target
    assert spare_joined  # the spare node took a rank
    st = checkpoint.load_latest(cfg["checkpoint"]["dir"])
    assert st.version == target
    c = TrainerConfig(**cfg)
    model, _ = build_model(c)
    learner = build_learner(model, build_optimizer(model, c), c)
    learner.checkpoint.load(cfg["checkpoint"]["dir"], st.model, st.optimizer)
    straight, stats = one_process(cfg, samples, target)
    # why: world 2 (and the re-formed group) sums gradients in another order: AdamW's bound over the steps
    assert_runs_close(dict(model.named_parameters()), straight.model, cfg, samples, [s["lr"] for s in stats])
