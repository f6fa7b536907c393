"""`asyncrl up` with a device plan ([layout], asyncrl/layout.py): the trainer group under torchrun
(2 gloo ranks, FSDP2) and one rollout worker per engine device, each child with its device
environment; the sharded run resumes, its final eval and W&B run work, and `asyncrl export` of its
DCP checkpoint writes the same HF folder as a gathered checkpoint and as the published (gathered)
weights replayed from the store, which `transformers` loads with the trainer's logits. Every
refusal of the plan is a clear error before anything starts."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from asyncrl import config_check, layout
from asyncrl.export import write_export
from asyncrl.report import read_jsonl
from asyncrl.supervisor import ChildSpec
from bench.up_driver import ROOT, kill_run, start_up, trainer_version, wait_for
from kernel.config import ConfigError
from tests.helpers.up import SUPERVISE
from trainer import checkpoint

CPU_LAYOUT = '[layout]\naccelerator = "cpu"\ndevices = 4\ntrainer_devices = [0, 1]\nengine_devices = [2, 3]\n'


def plan_of(conf: dict, environ=None):
    return layout.plan(conf, config_check.resolve(conf, environ={}), environ=environ)


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


# -- the plan -------------------------------------------------------------------------------------


def test_cpu_plan_places_every_child():
    p = plan_of(
        {"layout": {"accelerator": "cpu", "devices": 4, "trainer_devices": [0, 1], "engine_devices": [2, 3]}}
    )
    assert (p.ranks, p.workers, p.engines) == (2, 2, ((2,), (3,)))
    assert p.trainer_launch() == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    specs = [
        ChildSpec("trainer", "trainer", "trainer", {}),
        ChildSpec("scorer-0", "scorer", "scorer", {}),
        ChildSpec("worker-0", "rollout_worker", "rollout_worker", {"engine": {"seed": 1000}}),
        ChildSpec("worker-1", "rollout_worker", "rollout_worker", {"engine": {"seed": 1001}}),
    ]
    env = {s.name: (s.env, s.launch, s.conf) for s in p.apply(specs)}
    assert env["trainer"][0] == {"CUDA_VISIBLE_DEVICES": "", "ASYNCRL_DEVICES": "cpu:0,cpu:1"}
    assert env["trainer"][1][-1] == "--nproc_per_node=2"
    assert env["worker-1"][0] == {"CUDA_VISIBLE_DEVICES": "", "ASYNCRL_DEVICES": "cpu:3"}
    assert env["worker-1"][2] == {"engine": {"seed": 1001}}  # a cpu engine stays on the cpu
    assert env["scorer-0"][0]["CUDA_VISIBLE_DEVICES"] == ""
    assert p.worker_count(None) == 2
    with pytest.raises(ConfigError, match="--workers 3 disagrees"):
        p.worker_count(3)


def test_cuda_plan_tensor_parallel_groups_and_up_visible_devices():
    """The ids index the GPUs `up` sees: under CUDA_VISIBLE_DEVICES=2,3,5,7,9,11 id 1 is GPU 3."""
    conf = {
        "layout": {"accelerator": "cuda", "trainer_devices": [0, 1], "engine_devices": [2, 3, 4, 5]},
        "worker": {"engine": {"kind": "vllm", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.8}},
        "trainer": {"policy": {"model": {"preset": "tiny"}}},
        "up": {"workers": 2},
    }
    conf["layout"]["device_memory_gib"] = 80
    p = plan_of(conf, environ={"CUDA_VISIBLE_DEVICES": "2,3,5,7,9,11"})
    assert p.devices == 6 and p.engines == ((2, 3), (4, 5))
    assert p.trainer_env() == {"CUDA_VISIBLE_DEVICES": "2,3", "ASYNCRL_DEVICES": "cuda:0,cuda:1"}
    assert p.env(p.engines[1])["CUDA_VISIBLE_DEVICES"] == "9,11"
    text = "\n".join(p.lines())
    assert "2 ranks under torchrun, FSDP2 (nccl)" in text and "worker-1 on cuda:4,cuda:5" in text
    assert "trainer memory per device" in text
    # a torch engine under a cuda layout runs on its one visible GPU
    conf["worker"] = {"engine": {"kind": "torch"}}
    conf["layout"]["engine_devices"] = [2, 3]
    conf["up"] = {}
    spec = ChildSpec("worker-1", "rollout_worker", "rollout_worker", {"engine": {"kind": "torch"}})
    (placed,) = plan_of(conf, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}).apply([spec])
    assert placed.conf["engine"]["device"] == "cuda" and placed.env["CUDA_VISIBLE_DEVICES"] == "3"


def test_a_7b_plan_on_one_8gpu_node_fits_four_trainer_devices_not_two():
    """Qwen2.5-7B's shapes (the docs' example): 4 x 80 GiB hold the step, 2 do not."""
    qwen7b = {
        "preset": "tiny",
        "d_model": 3584,
        "n_layers": 28,
        "n_heads": 28,
        "n_kv_heads": 4,
        "d_ff": 18944,
        "vocab_size": 152064,
        "qkv_bias": True,
    }
    conf = {
        "layout": {
            "accelerator": "cuda",
            "devices": 8,
            "trainer_devices": [0, 1, 2, 3],
            "engine_devices": [4, 5, 6, 7],
            "device_memory_gib": 80,
        },
        "trainer": {"policy": {"model": qwen7b}, "loss": {"micro_batch_tokens": 8192}},
        "worker": {"engine": {"kind": "vllm"}},
    }
    p = plan_of(conf, environ={})
    assert 7.6e9 < p.memory["params"] < 7.7e9 and p.memory["need"] < 0.9 * 80 * 2**30
    conf["layout"]["trainer_devices"], conf["layout"]["engine_devices"] = [0, 1], [2, 3, 4, 5, 6, 7]
    with pytest.raises(ConfigError, match="does not fit the trainer's share"):
        plan_of(conf, environ={})


@pytest.mark.parametrize(
    "table, extra, message",
    [
        (
            {"trainer_devices": [0, 1], "engine_devices": [1, 2]},
            {},
            r"overlap: device\(s\) \[1\] are in both",
        ),
        ({"trainer_devices": [0, 0], "engine_devices": [2]}, {}, "overlap: trainer_devices lists device"),
        ({"trainer_devices": [0, 1], "engine_devices": [2, 4]}, {}, r"too few devices: device id\(s\) \[4\]"),
        ({"trainer_devices": [], "engine_devices": []}, {}, "places nothing"),
        ({"trainer_devices": [0], "engine_devices": [1], "gpus": 2}, {}, r"unknown key\(s\) \['gpus'\]"),
        ({"trainer_devices": [0], "engine_devices": "1"}, {}, "engine_devices: expected a list"),
        (
            {"trainer_devices": [0], "engine_devices": [1]},
            {"up": {"trainers": 2}},
            "standby trainer group needs devices",
        ),
        (
            {"trainer_devices": [0], "engine_devices": [1, 2]},
            {"up": {"workers": 3}},
            r"\[up\] workers = 3 disagrees",
        ),
        (
            {"trainer_devices": [0], "engine_devices": [1]},
            {"trainer": {"policy": {"device": "cuda"}}},
            "accelerator = 'cpu'",
        ),
    ],
)
def test_plan_refusals(table, extra, message):
    conf = {"layout": {"accelerator": "cpu", "devices": 4, **table}, **extra}
    with pytest.raises(ConfigError, match=message):
        plan_of(conf)


def test_cuda_plan_refusals_without_enough_gpus():
    base = {"accelerator": "cuda", "trainer_devices": [0], "engine_devices": [1, 2, 3]}
    with pytest.raises(ConfigError, match="too few devices: devices = 8, this node has 4"):
        plan_of({"layout": {**base, "devices": 8}}, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    with pytest.raises(ConfigError, match="too few devices: no CUDA device visible"):
        plan_of({"layout": base}, environ={"CUDA_VISIBLE_DEVICES": ""})
    tp = {"worker": {"engine": {"kind": "vllm", "tensor_parallel_size": 2}}}
    with pytest.raises(ConfigError, match="not a multiple of .* tensor_parallel_size = 2"):
        plan_of({"layout": {**base, "devices": 4}, **tp}, environ={})
    with pytest.raises(ConfigError, match="device = 'cuda:1': under a cuda"):
        plan_of({"layout": {**base, "devices": 4}, "worker": {"engine": {"device": "cuda:1"}}}, environ={})


# -- refusals as a user meets them: config check, and up before anything starts ----------------------


@pytest.mark.parametrize(
    "table, message",
    [
        (
            CPU_LAYOUT.replace("engine_devices = [2, 3]", "engine_devices = [1, 2]"),
            "overlap: device(s) [1] are in both trainer_devices and engine_devices",
        ),
        (
            CPU_LAYOUT.replace("devices = 4", "devices = 3"),
            "too few devices: device id(s) [3] but devices = 3",
        ),
        (
            CPU_LAYOUT + "device_memory_gib = 0.25\n",
            "the model does not fit the trainer's share",
        ),
    ],
    ids=["overlap", "too-few-devices", "too-large"],
)
def test_refused_by_config_check_and_by_up_before_anything_starts(tmp_path, table, message):
    cfg = tmp_path / "run.toml"
    cfg.write_text(SUPERVISE + table)
    r = cli("config", "check", str(cfg))
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    r = cli("up", "--config", str(cfg), "--run-dir", str(tmp_path / "run"), "--quiet")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"asyncrl up: bad configuration: [layout] {message}" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_config_check_prints_the_plan(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(SUPERVISE + CPU_LAYOUT)
    r = cli("config", "check", str(cfg))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "device plan ([layout]): 4 cpu device(s)" in r.stdout
    assert "trainer: 2 ranks under torchrun, FSDP2 (gloo) on cpu:0,cpu:1" in r.stdout
    assert "worker-1 on cpu:3" in r.stdout and "trainer memory per device" in r.stdout


# -- the run --------------------------------------------------------------------------------------


def device_lines(log_path) -> list[dict]:
    out = []
    for line in log_path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "devices":
            out.append(rec)
    return out


def steps_of(run_dir) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "samples" in r]


def hf_files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "README.txt"}


def assert_placed(run_dir) -> None:
    """Each child's own account of its devices (logged from its environment at start)."""
    ranks = device_lines(run_dir / "logs" / "trainer.log")
    assert sorted((r["rank"], r["local_rank"], r["world_size"]) for r in ranks) == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert {(r["plan"], r["cuda_visible_devices"], r["device"]) for r in ranks} == {
        ("cpu:0,cpu:1", "", "cpu")
    }
    for i in (0, 1):
        (w,) = device_lines(run_dir / "logs" / f"worker-{i}.log")
        assert (w["plan"], w["cuda_visible_devices"], w["device"], w["rank"]) == (
            f"cpu:{2 + i}",
            "",
            "cpu",
            None,
        )
    meta = json.loads((run_dir / "config" / "run.json").read_text())
    assert meta["layout"]["trainer_env"] == {"CUDA_VISIBLE_DEVICES": "", "ASYNCRL_DEVICES": "cpu:0,cpu:1"}
    assert meta["workers"] == 2  # one per engine device


def assert_exports(run_dir, st, tmp_path, transformers) -> None:
    """`asyncrl export` of the sharded checkpoint `st`: the same HF folder as the gathered weights
    and as the published weights replayed from the store; transformers gives the trainer's logits.
    (Synchronous: the replay starts its own event loop; call it from a thread in an async test.)"""
    # export of the sharded checkpoint == export of the same weights gathered into one file ...
    exported = write_export(run_dir, tmp_path / "hf")
    assert exported["version"] == st.version and exported["source"].startswith("checkpoint")
    from policy import ModelConfig, Transformer
    from trainer.shards import load_model_state

    model = Transformer(ModelConfig.from_dict(st.model_config)).eval()
    load_model_state(model, run_dir / "checkpoints", st.model)
    gathered = tmp_path / "gathered"
    shutil.copytree(run_dir / "config", gathered / "config")
    checkpoint.save(
        gathered / "checkpoints",
        checkpoint.TrainerState(
            version=st.version,
            epoch=st.epoch,
            model=model.state_dict(),
            optimizer={},
            digest=st.digest,
            model_config=st.model_config,
        ),
    )
    write_export(gathered, tmp_path / "hf-gathered")
    assert hf_files(tmp_path / "hf") == hf_files(tmp_path / "hf-gathered")
    # ... == the published bf16 weights (gathered by the group as it ran), replayed from the store
    replayed = tmp_path / "replayed"
    shutil.copytree(run_dir / "config", replayed / "config")
    shutil.copytree(run_dir / "nats", replayed / "nats")
    got = write_export(replayed, tmp_path / "hf-replayed", st.version)
    assert "replayed" in got["source"]
    assert hf_files(tmp_path / "hf") == hf_files(tmp_path / "hf-replayed")

    # transformers loads it with the trainer's logits (its published bf16 point)
    from policy.model import inference_state
    from tests.helpers.tolerance import transformers_tol

    ours = Transformer(model.cfg).eval()
    ours.load_inference_state({k: v.float() for k, v in inference_state(model).items()})
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(idx)
        # why: transformers runs the same math in its own kernels and order, its RoPE angles in fp32
        torch.testing.assert_close(
            ref(idx).logits.float(), want, **transformers_tol(ours.cfg, want, idx.shape[1])
        )


async def test_layout_run_places_the_group_and_exports_its_shards(tmp_path):
    """The short version (default suite): 2 versions, each child on its devices, the sharded
    checkpoint exported. The whole story (resume, final eval, W&B) is the chaos test below."""
    transformers = pytest.importorskip("transformers")
    config = SUPERVISE.replace("workers = 2\n", "").replace("max_tokens = 40", "max_tokens = 24") + CPU_LAYOUT
    proc, run_dir = start_up(tmp_path, config, steps=2, minutes=6)
    out = tmp_path / "up.out"
    try:
        assert await asyncio.to_thread(proc.wait, 500) == 0, out.read_text()[-3000:]
    finally:
        kill_run(run_dir)
    assert_placed(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"].startswith("reached"), summary
    st = checkpoint.load_latest(run_dir / "checkpoints")
    assert "__dcp__" in st.model and st.version >= 2  # written by both ranks
    await asyncio.to_thread(assert_exports, run_dir, st, tmp_path, transformers)


@pytest.mark.chaos  # minutes on a loaded 2-core box: two torchrun parts, W&B, final eval (make test-chaos)
async def test_layout_run_two_rank_group_resumes_and_exports(tmp_path):
    pytest.importorskip("wandb", reason="wandb is a dev extra (pip install -e .[dev])")
    transformers = pytest.importorskip("transformers")
    # the workers come from the plan: one per engine device ([up] workers left out)
    config = (
        SUPERVISE.replace(
            "workers = 2\n", 'final_eval = true\nwandb_project = "asyncrl-test"\nwandb_mode = "offline"\n'
        )
        .replace("eval_prompts = 16", "eval_prompts = 4")
        .replace("max_tokens = 40", "max_tokens = 24")
        + CPU_LAYOUT
    )
    os.environ.setdefault("WANDB_SILENT", "true")
    proc, run_dir = start_up(tmp_path, config, steps=500, minutes=8)
    out = tmp_path / "up.out"
    try:
        await wait_for(lambda: trainer_version(run_dir) >= 2, 400, "version 2", proc, out)
        assert_placed(run_dir)
        os.killpg(proc.pid, signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 120) == 0, out.read_text()[-3000:]
    finally:
        kill_run(run_dir)
    first = steps_of(run_dir)
    v1 = max(r["version"] for r in first)
    st = checkpoint.load_latest(run_dir / "checkpoints")
    assert "__dcp__" in st.model and st.version == v1  # written by both ranks

    # resumed: the same plan from the run's own config, on to v1 + 2, then the final eval
    r = await asyncio.to_thread(
        cli, "up", "--resume", str(run_dir), "--steps", str(v1 + 2), "--minutes", "6", "--quiet", timeout=600
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["stopped"].startswith("reached"), summary
    assert summary["final_eval"] == "done", summary
    versions = [x["version"] for x in steps_of(run_dir)]
    assert versions == list(range(1, max(versions) + 1)) and max(versions) >= v1 + 2  # no gap, no repeat
    rows = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    final = [x for x in rows if x.get("eval_final")]
    st = checkpoint.load_latest(run_dir / "checkpoints")
    assert "__dcp__" in st.model and final and final[-1]["version"] == st.version
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) == 2  # one W&B run, both parts

    await asyncio.to_thread(assert_exports, run_dir, st, tmp_path, transformers)
