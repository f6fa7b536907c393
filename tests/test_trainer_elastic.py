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
    cfg = TrainerConfig(trainer_id="g", elastic_nnodes="2:3", elastic_nproc_per_node=8,
                        elastic_rdzv_endpoint="head:29500", elastic_rdzv_id="run7", elastic_max_restarts=5,
                        elastic_rdzv_host=True, elastic_rdzv_conf="join_timeout=120")
    argv = torchrun_argv(cfg, ["--config", "t.toml"], python="py")
    assert argv[:3] == ["py", "-m", "torch.distributed.run"]
    for flag in ("--nnodes=2:3", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=head:29500",
                 "--rdzv_id=run7", "--max_restarts=5", "--rdzv_conf=is_host=1,join_timeout=120"):
        assert flag in argv, flag
    assert argv[-4:] == ["-m", "trainer", "--config", "t.toml"]      # the ranks run the plain trainer
    assert "--rdzv_conf=is_host=0" in torchrun_argv(TrainerConfig(trainer_id="g"), [])
    # without this a spare that joins as rank > 0 waits forever for the workers' store
    assert agent_env({"A": "1"}) == {"A": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.mark.parametrize("bad", [{"elastic_nnodes": "3:2"}, {"elastic_nnodes": "0:2"}, {"elastic_nnodes": "two"},
                                 {"elastic_nnodes": "1:2:3"}, {"elastic_nproc_per_node": 0},
                                 {"elastic_max_restarts": -1}, {"elastic_rdzv_endpoint": "nohostport"}])
def test_bad_elastic_settings_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        TrainerConfig(trainer_id="g", **bad)


def test_elastic_flag_with_bad_config_fails_clearly_before_torchrun(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text('[trainer]\ntrainer_id = "g"\nelastic_nnodes = "3:2"\n')
    r = subprocess.run([sys.executable, "-m", "trainer", "--elastic", "--config", str(cfg)], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "elastic_nnodes" in r.stderr, r.stderr[-2000:]
    assert "torch.distributed.run" not in r.stderr
