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
    write_gguf(tmp_path / "m.gguf", tiny_llama(tok.get_vocab_size(), True, max_pos=512), tok, {"attn_q": "Q4_1"})
    folder = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    # lr 0.5: AdamW's weight decay alone (0.5 % a step) moves bf16 weights, so deltas really reach the engine
    assert realmodel.main(["--json", "--folder", str(folder), "--lrs", "0.5", "--steps", "2", "--tasks", "1",
                           "--group", "2", "--max-new", "6", "--max-len", "400", "--slots", "1", "2",
                           "--decode-tokens", "3", "--out", str(tmp_path / "states")]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (run,) = res["runs"]
    assert run["lr"] == 0.5 and len(run["steps"]) == 2 and run["cumulative"]["changed_frac"] > 0
    assert all(s["changed_frac"] > 0 and s["bits_per_changed"] > 0 and s["tokens"] > 0 for s in run["steps"]), run["steps"]
    # the second step samples from the delta-updated engine: still the trainer's numbers
    assert run["k3_published_max"] <= 1e-6
    assert [d["slots"] for d in res["decode"]] == [1, 2] and all(d["tokens"] == 3 * d["slots"] for d in res["decode"])
    base, new = load_file(str(tmp_path / "states" / "base.safetensors")), load_file(str(tmp_path / "states" / "lr0.5.safetensors"))
    assert base.keys() == new.keys() and all(v.dtype == torch.bfloat16 for v in new.values())
    assert any(not torch.equal(base[k], new[k]) for k in base)
