"""bench.realmodel end to end on a tiny converted GGUF model (the real SmolLM2 run is the lead's):
RL steps through the torch engine, sandboxed rewards, replay, AdamW, deltas into the engine,
decode speed; one JSON object last; the bf16 states saved for codec runs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from bench import realmodel  # noqa: E402
from policy.gguf import convert_gguf  # noqa: E402
from tests.helpers.gguf import bpe_tokenizer, tiny_llama, write_gguf  # noqa: E402


def test_advantages_are_group_relative_and_ties_give_none():
    adv = realmodel.advantages([1.0, 0.0, 0.5, 0.5, 0.2, 0.2], group=2)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_reward_runs_the_unit_tests_in_the_sandbox():
    from envs.python_tests import PythonTestsEnv

    env = PythonTestsEnv(n_tests=3)
    spec = env.make_task("gcd", __import__("random").Random(0)).spec
    good = "```python\ndef gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n```"
    assert realmodel.reward(env, good, spec) == pytest.approx(1.1)
    assert realmodel.reward(env, "def gcd(a, b):\n    return -1\n", spec) == pytest.approx(0.1)
    assert realmodel.reward(env, "no code here", spec) == 0.0


def test_bench_runs_end_to_end_on_a_tiny_converted_model(tmp_path, capsys):
    tok = bpe_tokenizer()
    write_gguf(
        tmp_path / "m.gguf", tiny_llama(tok.get_vocab_size(), True, max_pos=512), tok, {"attn_q": "Q4_1"}
    )
    folder = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    # lr 0.5: AdamW's weight decay alone (0.5 % a step) moves bf16 weights, so deltas really reach the engine
    assert (
        realmodel.main(
            [
                "--json",
                "--folder",
                str(folder),
                "--lrs",
                "0.5",
                "--steps",
                "2",
                "--tasks",
                "1",
                "--group",
                "2",
                "--max-new",
                "6",
                "--max-len",
                "400",
                "--slots",
                "1",
                "2",
                "--decode-tokens",
                "3",
                "--out",
                str(tmp_path / "states"),
                "--no-vllm",
                "--profile-steps",
                "2",
                "--profile-tasks",
                "1",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the trainer's own step, split by phase and set against this machine's matmul rate
    prof = res["step_profile"]
    assert prof["steps"] == 2 and prof["sequences"] == 2
    assert prof["delta_context"] is True  # auto: a pretrained start
    assert prof["step_flops"] > 0 and prof["matmul_flop_s"] > 0 and prof["step_s"] > 0
    assert (
        res["step_flops_fraction"]
        == prof["step_flops_fraction"]
        == pytest.approx(prof["step_flops"] / prof["step_s"] / prof["matmul_flop_s"])
    )
    assert set(prof["phases_s"]) == {
        "forward",
        "replay",
        "backward",
        "optimizer",
        "cast",
        "encode",
        "checkpoint",
        "publish",
    }
    ph = prof["phases_s"]
    assert all(v >= 0 for v in ph.values()) and ph["forward"] + ph["replay"] > 0
    assert all(ph[k] > 0 for k in ("backward", "optimizer", "cast", "encode", "checkpoint", "publish"))
    assert sum(prof["phase_frac"].values()) == pytest.approx(1.0)
    (run,) = res["runs"]
    assert run["lr"] == 0.5 and len(run["steps"]) == 2 and run["cumulative"]["changed_frac"] > 0
    assert all(
        s["changed_frac"] > 0 and s["bits_per_changed"] > 0 and s["tokens"] > 0 for s in run["steps"]
    ), run["steps"]
    # the second step samples from the delta-updated engine: still the trainer's numbers
    assert run["k3_published_max"] <= 1e-6
    assert [d["slots"] for d in res["decode"]] == [1, 2] and all(
        d["tokens"] == 3 * d["slots"] for d in res["decode"]
    )
    assert res["vllm"] == {"skipped": "--no-vllm"}
    assert [(r["slots"], r["vllm_tokens_per_s"], r["faster"]) for r in res["decode_side_by_side"]] == [
        (1, None, None),
        (2, None, None),
    ]
    base, new = (
        load_file(str(tmp_path / "states" / "base.safetensors")),
        load_file(str(tmp_path / "states" / "lr0.5.safetensors")),
    )
    assert base.keys() == new.keys() and all(v.dtype == torch.bfloat16 for v in new.values())
    assert any(not torch.equal(base[k], new[k]) for k in base)


def test_side_by_side_rows_name_the_faster_engine():
    rows = realmodel.side_by_side(
        [
            {"slots": 1, "tokens_per_s": 10.0},
            {"slots": 8, "tokens_per_s": 40.0},
            {"slots": 32, "tokens_per_s": 50.0},
        ],
        [{"slots": 1, "tokens_per_s": 5.0}, {"slots": 8, "tokens_per_s": 80.0}],
    )
    assert [(r["slots"], r["vllm_over_torch"], r["faster"]) for r in rows] == [
        (1, 0.5, "torch"),
        (8, 2.0, "vllm"),
        (32, None, None),
    ]


def test_a_failing_vllm_interpreter_is_reported_and_torch_numbers_stay(tmp_path, capsys):
    """The vLLM part runs in the vLLM venv's interpreter when vllm does not import here; one that
    cannot run it (missing, or without vllm) gives a reason, not a crash or a silent gap."""
    import sys

    if realmodel.vllm_missing() is None:
        pytest.skip("vllm imports here: the bench runs the vLLM part in-process")
    tok = bpe_tokenizer()
    write_gguf(tmp_path / "m.gguf", tiny_llama(tok.get_vocab_size(), True, max_pos=512), tok, {})
    folder = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    common = [
        "--json",
        "--folder",
        str(folder),
        "--lrs",
        "--slots",
        "1",
        "--decode-tokens",
        "2",
        "--max-new",
        "2",
        "--profile-steps",
        "0",
    ]
    assert realmodel.main([*common, "--vllm-python", str(tmp_path / "no-python")]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["vllm"] == {"skipped": f"no vLLM interpreter at {tmp_path / 'no-python'}"}
    assert res["decode_side_by_side"][0]["torch_tokens_per_s"] > 0
    # this interpreter has no vllm: the subprocess fails, and says where to look
    assert realmodel.main([*common, "--vllm-python", sys.executable]) == 0
    out = capsys.readouterr()
    res = json.loads(out.out.strip().splitlines()[-1])
    assert res["vllm"]["skipped"].startswith(f"the vLLM part failed (exit 1) in {sys.executable}")
    assert "vllm" in out.err.lower()
