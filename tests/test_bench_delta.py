"""bench.delta on saved before/after states (`--states DIR`, the folder `bench.realmodel --out`
writes): one row per lr file, format 2 and format 3 side by side, the conditional bound computed
on those states, a clear error for a folder that is not one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from bench import delta as bench_delta


def saved_states(tmp_path, lrs=(1e-6, 1e-5)):
    """base.safetensors + lr<lr>.safetensors: bf16 weights after a few real AdamW steps."""
    g = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(300, 256, generator=g) * 0.02, "norm": 1 + torch.randn(256, generator=g) * 0.02}
    base = {k: v.to(torch.bfloat16) for k, v in init.items()}
    save_file(base, str(tmp_path / "base.safetensors"))
    afters = {}
    for lr in lrs:
        _, after = bench_delta.rl_update(init, lr, warmup=2, seed=1)
        save_file(after, str(tmp_path / f"lr{lr:g}.safetensors"))
        afters[lr] = after
    return base, afters


def run(argv, capsys) -> dict:
    bench_delta.main(argv)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_states_rows_are_the_saved_deltas(tmp_path, capsys):
    base, afters = saved_states(tmp_path)
    out = run(["--json", "--states", str(tmp_path), "--reps", "1", "--lrs", "0.1"], capsys)
    assert out["source"] == "states" and out["weights"] == str(tmp_path)
    assert [r["lr"] for r in out["runs"]] == [1e-6, 1e-5]  # the files', not --lrs
    for r in out["runs"]:
        after = afters[r["lr"]]
        changed = sum(int((base[k].view(torch.int16) != after[k].view(torch.int16)).sum()) for k in base)
        assert r["changed"] == changed > 0 and r["params"] == 300 * 256 + 256
        cond = bench_delta.conditional_position_entropy(base, after) / changed
        assert r["position_entropy_cond_bits"] == pytest.approx(cond)
        assert r["position_entropy_cond_bits"] <= r["position_entropy_bits"]
        assert r["bits_per_changed"] > 0 and r["format2"]["bits_per_changed"] > 0
        assert r["baselines"]["full_bf16"] == 1.0


def test_conditional_entropy_of_float32_uses_its_exponent():
    """A mask that is a function of the exponent has conditional entropy 0, at any float width."""
    x = torch.tensor([0.001, 0.5, 0.002, 0.7, 0.004, 0.9] * 50, dtype=torch.float32)
    y = x.clone()
    y[x < 0.1] += 1e-6  # changes exactly the small ones
    assert bench_delta.conditional_position_entropy({"a": x}, {"a": y}) == pytest.approx(0.0, abs=1e-9)
    xb = x.to(torch.bfloat16)
    flip = xb.clone()
    flip.view(torch.int16)[::2] ^= 1  # every other element, i.e. the small ones here
    assert bench_delta.conditional_position_entropy({"a": xb}, {"a": flip}) == pytest.approx(0.0, abs=1e-9)
    rnd = xb.clone()
    rnd.view(torch.int16)[np.random.default_rng(0).random(300) < 0.5] ^= 1
    assert bench_delta.conditional_position_entropy({"a": xb}, {"a": rnd}) > 100


@pytest.mark.parametrize("files", [[], ["lr1e-06.safetensors"], ["base.safetensors"]])
def test_a_folder_without_base_or_lr_states_is_refused_clearly(tmp_path, files, capsys):
    for f in files:
        save_file({"w": torch.zeros(4, dtype=torch.bfloat16)}, str(tmp_path / f))
    with pytest.raises(SystemExit, match="base.safetensors|lr<lr>"):
        bench_delta.main(["--json", "--states", str(tmp_path), "--reps", "1"])


def test_states_that_do_not_match_the_base_are_refused(tmp_path):
    save_file({"w": torch.zeros(4, dtype=torch.bfloat16)}, str(tmp_path / "base.safetensors"))
    save_file({"w": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "lr1e-06.safetensors"))
    with pytest.raises(SystemExit, match="differ from base"):
        bench_delta.main(["--json", "--states", str(tmp_path), "--reps", "1"])
