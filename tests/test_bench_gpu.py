"""bench.gpu stays runnable on machines without a GPU: the dry run goes through the same trainer
and delta-apply code on the CPU (bit-exact against the CPU reference), and without CUDA the real
check stops at once with a clear message instead of running on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_dry_run_runs_the_sections_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    p = run("--dry-run", "--json", "--out", str(out), "--llama8b", "--logprob-memory", timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == json.loads(out.read_text())
    assert res["dry_run"] and res["device"] == "cpu" and res["ok"] and res["errors"] == {}
    tr = res["sections"]["trainer"]
    assert len(tr["steps"]) == 2 and all(abs(s["loss"]) < 1e3 and s["grad_norm"] > 0 for s in tr["steps"])
    assert 0 < tr["delta"]["changed_frac"] <= 1  # the steps really moved the published weights
    ap = res["sections"]["apply"]
    assert [k["changed_frac"] for k in ap["kernel"]] == [0.01, 0.1, 1.0]
    assert all(k["bit_exact"] and k["gb_s"] > 0 for k in ap["kernel"])
    assert ap["codec_apply"]["bit_exact"]
    assert tr["fsdp"]  # the trainer ran sharded (a world-1 gloo group)
    eng = res["sections"]["engine"]
    assert [r["slots"] for r in eng["throughput"]] == [1, 2] and all(
        r["tokens"] > 0 for r in eng["throughput"]
    )
    inf = eng["inflight_delta"]
    # the trainer's delta reached the engine's own state bit-exact while sequences decoded, in order
    assert inf["bit_exact"] and inf["versions_ordered"] and inf["state_on"] == "cpu"
    v = res["sections"]["vllm"]
    assert "skipped" in v and ("vllm" in v["skipped"])  # says why, never silently absent
    # the two child sections (their own tests: test_bench_gpu_llama8b.py, ..._logprob_memory.py)
    ll, lp = res["sections"]["llama8b"], res["sections"]["logprob_memory"]
    assert ll["ok"] and ll["scale"] == "tiny" and ll["tokens_per_s"] > 0 and ll["mfu"] is None
    assert lp["ok"] and lp["vocab"] == 1000 and all(r.get("allclose", True) for r in lp["runs"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this box has CUDA")
def test_without_cuda_it_stops_at_once_and_says_why(tmp_path):
    p = run("--json", "--out", str(tmp_path / "x.json"), timeout=60)
    assert p.returncode == 2 and "no CUDA device" in p.stderr and "--dry-run" in p.stderr
    assert p.stdout == "" and not (tmp_path / "x.json").exists()
    sh = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), str(tmp_path / "y.json")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sh.returncode == 2 and "no CUDA device" in sh.stderr and not (tmp_path / "y.json").exists()


def test_gpu_check_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(REPO / "bench" / "gpu_check.sh")]).returncode == 0
