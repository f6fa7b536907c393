"""λ calibration: the fit recovers a known curve's slope; the CLI measures, plots and applies."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import numpy as np
import pytest

from bus.control import format_lambda, parse_lambda
from policy import reward
from scorer.calibrate import cost_at_price, fit_scaling_curve, main, tangent_slope


@pytest.mark.parametrize(
    "a,b,tau,at,noise",
    [(0.9, 0.8, 20.0, 16.0, 0.005), (0.6, 0.55, 6.0, 4.0, 0.003), (0.95, 0.9, 40.0, 48.0, 0.004)],
)
def test_fit_recovers_known_slope_within_5_percent(a, b, tau, at, noise):
    rng = np.random.default_rng(1)
    c = np.array([2, 4, 6, 8, 12, 16, 24, 32, 48, 64], dtype=float)
    s = a - b * np.exp(-c / tau) + rng.normal(0, noise, c.size)
    fit = fit_scaling_curve(c, s)
    true_slope = b / tau * math.exp(-at / tau)
    assert tangent_slope(fit, at) == pytest.approx(true_slope, rel=0.05)
    price = true_slope  # the point where slope == price is `at`
    assert cost_at_price(fit, price) == pytest.approx(at, rel=0.05, abs=1.0)
    xs = np.linspace(0, 80, 50)
    assert (np.diff(fit.success(xs)) >= 0).all() and (np.diff(fit.slope(xs)) <= 0).all()  # monotone, concave


def test_fit_edge_cases():
    flat = fit_scaling_curve([1, 2, 3, 4], [0.3, 0.3, 0.3, 0.3])
    assert flat.b == 0 and tangent_slope(flat, 2) == 0 and cost_at_price(flat, 0.01) == 0
    convex = fit_scaling_curve([4, 8, 16, 24, 32, 48], [0, 0, 0, 0.1, 0.3, 0.5])
    assert convex.a <= 1.0 and convex.b > 0 and (convex.success(np.linspace(0, 200, 20)) <= 1.0).all()
    decreasing = fit_scaling_curve([1, 2, 3], [0.5, 0.4, 0.1])
    assert tangent_slope(decreasing, 2) == 0  # never a negative λ
    with pytest.raises(ValueError, match=">= 3 distinct costs"):
        fit_scaling_curve([1, 1, 2], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="same length"):
        fit_scaling_curve([1, 2, 3], [0.1, 0.2])
    with pytest.raises(ValueError):
        fit_scaling_curve([1, 2, float("nan")], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError):
        cost_at_price(flat, 0)


def test_reward_components():
    assert reward.price(1.0, 40, 0.01) == pytest.approx((0.4, 0.6))
    assert reward.price(0.0, 5, 0.0, shaping=0.25) == (0.25, -0.25)
    assert reward.overlong_shaping(30, 48, 8, 1.0) == 0 and reward.overlong_shaping(44, 48, 8, 1.0) == 0.5
    assert reward.overlong_shaping(60, 48, 8, 0.5) == 0.5 and reward.overlong_shaping(47, 48, 0, 1.0) == 0
    for bad in [(1.5, 1, 0.1), (0.5, -1, 0.1), (0.5, 1, float("inf"))]:
        with pytest.raises(ValueError):
            reward.price(*bad)
    assert parse_lambda(format_lambda(0.0025)) == 0.0025 and parse_lambda(b" 0.5\n") == 0.5
    for bad in [None, b"", b"abc", b"-1", b"nan", b"\xff"]:
        with pytest.raises(ValueError):
            parse_lambda(bad)


def test_calibrate_cli_measures_plots_and_applies(tmp_path, fresh_server):
    import torch

    from bus import BusConfig, connect
    from bus import topology as topo
    from policy import CharTokenizer, ModelConfig, Transformer

    cfg = ModelConfig.tiny(vocab_size=CharTokenizer.default().vocab_size, d_model=32, n_layers=1, d_ff=64)
    torch.manual_seed(0)
    torch.save(
        {"model": Transformer(cfg).state_dict(), "model_config": cfg.to_dict(), "version": 7},
        tmp_path / "ckpt-e00000001-v00000007.pt",
    )
    out = tmp_path / "cal.png"
    rc = main(
        [
            "--checkpoint",
            str(tmp_path),
            "--budgets",
            "2,3,5",
            "--prompts",
            "6",
            "--out",
            str(out),
            "--nats",
            fresh_server.url,
            "--apply",
        ]
    )
    assert rc == 0 and out.stat().st_size > 1000
    summary = json.loads((tmp_path / "cal.json").read_text())
    assert [p["budget"] for p in summary["points"]] == [2, 3, 5] and summary["lambda"] >= 0
    assert "version 7" in summary["policy"] and summary["operating_point"] == "budget 5"

    async def read():
        bus = await connect(BusConfig(servers=[fresh_server.url], name="t"))
        try:
            return await bus.kv_get(topo.KEY_LAMBDA)
        finally:
            await bus.close()

    async def publish_keyframe():  # the policy as workers get it: latest keyframe
        from bus.weights.publisher import WeightPublisher
        from policy import inference_state

        bus = await connect(BusConfig(servers=[fresh_server.url], name="t"))
        try:
            await bus.provision()
            torch.manual_seed(1)
            await WeightPublisher(bus, epoch=1, trainer_id="t").publish_keyframe(
                inference_state(Transformer(cfg)), version=11, model_config=cfg.to_dict()
            )
        finally:
            await bus.close()

    loop = asyncio.new_event_loop()
    try:
        assert parse_lambda(loop.run_until_complete(read())) == pytest.approx(summary["lambda"])
        loop.run_until_complete(publish_keyframe())
    finally:
        loop.close()
    assert main(["--nats", fresh_server.url, "--budgets", "2,3,4", "--prompts", "4", "--out", str(out)]) == 0
    assert "version 11" in json.loads((tmp_path / "cal.json").read_text())["policy"]
    assert (
        main(
            [
                "--checkpoint",
                str(tmp_path),
                "--axis",
                "samples",
                "--budgets",
                "1,2,3",
                "--max-tokens",
                "3",
                "--prompts",
                "3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "cal.json").read_text())["points"]
    assert [r["budget"] for r in rows] == [1, 2, 3] and rows[0]["cost"] < rows[1]["cost"] < rows[2]["cost"]
    with pytest.raises(SystemExit):
        main(["--random-init", "--apply"])  # --apply without --nats: a clear usage error
    (tmp_path / "empty").mkdir()
    assert main(["--checkpoint", str(tmp_path / "empty")]) == 2
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    assert main(["--checkpoint", str(tmp_path / "bad.pt")]) == 2


def test_calibrate_model_and_chat_template_refuse_bad_input(tmp_path, capsys):
    """--model on a folder that is not a model: exit 2 naming it; --chat-template without --model
    (the char tokenizer has no template): a usage error. Nothing is measured or written."""
    (tmp_path / "notamodel").mkdir()
    out = tmp_path / "cal.png"
    assert main(["--model", str(tmp_path / "notamodel"), "--out", str(out)]) == 2
    assert "cannot load model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--random-init", "--chat-template", "--out", str(out)])
    assert "--chat-template needs --model" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "cal.json").exists()


@pytest.fixture()
def small_swe_gen(tmp_path):
    """A 10-repository swe-gen set in tmp_path, standing in for the registered one."""
    from envs import base
    from envs.swe_env import SweGenEnv

    e = SweGenEnv(task_dir=str(tmp_path / "set"), n_gen=10)
    e.tasks("train")
    old = base._INSTANCES.get("swe-gen")
    base._INSTANCES["swe-gen"] = e
    yield e
    base._INSTANCES.pop("swe-gen")
    if old is not None:
        base._INSTANCES["swe-gen"] = old


def test_turns_axis_plays_the_same_episodes_at_each_turn_budget(small_swe_gen):
    """--axis turns: each budget caps max_turns of the same held-out episodes; the cost is the
    policy's own tokens (an untrained model's turns, each at most turn_tokens), never the prompt's."""
    import torch

    from policy import CharTokenizer, ModelConfig, Transformer
    from scorer.calibrate import measure_turns

    tok = CharTokenizer.default()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(tok.vocab_size, n_layers=1, max_seq_len=4096)).float().eval()
    small_swe_gen.limits = dataclasses.replace(small_swe_gen.limits, max_turn_tokens=24)
    with torch.no_grad():
        rows = measure_turns(model, "swe-gen", [1, 2], 3, 1.0, 0, tok)
    assert [r["budget"] for r in rows] == [1, 2] and all(r["n"] == 3 for r in rows)
    assert rows[0]["turns"] == 1.0 and 1.0 <= rows[1]["turns"] <= 2.0
    assert 0 < rows[0]["cost"] < rows[1]["cost"]  # a second turn is paid for
    assert all(r["success"] == 0.0 for r in rows)  # an untrained model fixes nothing


def test_turns_axis_refuses_a_single_answer_env(tmp_path, capsys):
    rc = main(
        [
            "--random-init",
            "--env",
            "arith",
            "--axis",
            "turns",
            "--prompts",
            "2",
            "--out",
            str(tmp_path / "c.png"),
        ]
    )
    assert rc == 2 and "multi-turn" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()
    rc = main(["--random-init", "--env", "no-such-env", "--prompts", "2", "--out", str(tmp_path / "c.png")])
    assert rc == 2 and "unknown environment 'no-such-env'" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


def test_samples_axis_on_episodes_prices_every_attempt(small_swe_gen):
    """--axis samples on a multi-turn env: k episodes a task, cost = the policy's tokens of all k."""
    import torch

    from policy import CharTokenizer, ModelConfig, Transformer
    from scorer.calibrate import measure_episode_samples, multi_turn

    assert multi_turn("swe-gen") and not multi_turn("arith")
    tok = CharTokenizer.default()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(tok.vocab_size, n_layers=1, max_seq_len=4096)).float().eval()
    small_swe_gen.limits = dataclasses.replace(small_swe_gen.limits, max_turn_tokens=24, max_turns=1)
    with torch.no_grad():
        rows = measure_episode_samples(model, "swe-gen", [1, 2], 3, 1.0, 0, tok)
    assert [r["budget"] for r in rows] == [1, 2] and all(r["n"] == 3 for r in rows)
    assert 0 < rows[0]["cost"] < rows[1]["cost"] <= 2 * 24  # two attempts, each one turn of <= 24 tokens
    assert all(r["success"] == 0.0 for r in rows)
