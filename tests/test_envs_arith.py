"""arith: verifier on known-good and known-bad answers, disjoint splits, demonstration styles."""

from __future__ import annotations

import random

import numpy as np
import pytest

from envs import ENVS, SpecError, get_env
from envs.arith import ArithEnv, steps_text


@pytest.fixture(scope="module")
def env():
    return get_env("arith")


def test_registry():
    assert {"arith", "arith-long", "python-tests"} <= set(ENVS)
    with pytest.raises(KeyError, match="unknown environment 'nope'"):
        get_env("nope")


def test_steps_text_is_column_addition():
    assert steps_text(123, 4567) == "3+7+0=10 2+6+1=09 1+5+0=06 0+4+0=04 #4690"
    assert steps_text(99, 1) == "9+1+0=10 9+0+1=10 #100"
    assert steps_text(57, 68, width=4) == "7+8+0=15 5+6+1=12 0+0+1=01 0+0+0=00 #0125"


@pytest.mark.parametrize("rng", [random.Random(0), np.random.default_rng(0)], ids=["random", "numpy"])
def test_demonstrations_verify_and_fit_the_budget(env, rng):
    for _ in range(300):
        t = env.sample(rng)
        a, b = t.spec["a"], t.spec["b"]
        assert t.prompt == f"{a}+{b}=" and 10 <= a <= 9999 and 10 <= b <= 9999
        steps, direct = env.demonstration(t.spec, "steps"), env.demonstration(t.spec, "direct")
        assert len(steps) + 1 <= 48 and len(direct) + 1 <= 7  # + eos
        assert env.verify(steps, t.spec).success == 1.0
        assert env.verify(direct, t.spec).success == 1.0
        padded = env.demonstration(t.spec, "padded")
        assert env.verify(padded, t.spec).success == 1.0 and len(padded) > len(steps)
        assert env.demonstration(t.spec, "mixed") in (steps, direct)
        assert env.demonstration(t.spec) in (steps, direct, padded)


def test_default_mixture_holds_all_three_styles():
    from envs.arith import ArithEnv

    small, r = ArithEnv("arith-small", 1, 2), random.Random(3)
    kinds = [small.demonstration(small.sample(r).spec) for _ in range(600)]
    n_direct = sum(k.startswith("#") for k in kinds)
    n_padded = sum(k.count("=") == 4 for k in kinds)  # arith-small pads to 2 + 2 columns
    assert 150 < n_direct < 250 and 150 < n_padded < 250


def test_known_bad_answers(env):
    spec = {"a": 12, "b": 30, "answer": "42"}
    for text, why in [
        ("#41", "wrong answer 41 != 42"),
        ("42", "no final answer"),
        ("", "no final answer"),
        ("#42 and more", "no final answer"),
        ("#4x2", "no final answer"),
        ("#" + "9" * 70, "no final answer"),
        ("\x00\x01", "no final answer"),
    ]:
        v = env.verify(text, spec)
        assert v.success == 0.0 and why in v.reason, (text, v)
    assert env.verify("2+0+0=02 1+3+0=04 #42\n", spec).success == 1.0  # trailing whitespace is fine
    assert env.verify("#41 #42", spec).success == 1.0  # the last marker counts
    assert env.verify("#042", spec).success == 1.0
    assert env.verify(None, spec).success == 0.0


def test_bad_spec_is_an_error_not_a_score(env):
    for spec in [{}, {"answer": "x"}, {"answer": -3}, "nope", {"answer": None}]:
        with pytest.raises(SpecError):
            env.verify("#1", spec)
    with pytest.raises(SpecError):
        env.demonstration({"a": 1, "b": 2, "answer": "4"}, "steps")
    with pytest.raises(ValueError, match="unknown style"):
        env.demonstration({"a": 1, "b": 2, "answer": "3"}, "poetry")
    with pytest.raises(ValueError, match="unknown split"):
        env.sample(random.Random(0), "test")


def test_eval_split_is_disjoint_and_long_env_has_a_tail(env):
    r = random.Random(1)
    train = {env.sample(r, "train").prompt for _ in range(3000)}
    ev = {env.sample(r, "eval").prompt for _ in range(600)}
    assert train and ev and not (train & ev)
    long = get_env("arith-long")
    lens = np.array([len(long.demonstration(long.sample(r).spec, "steps")) for _ in range(2000)])
    assert lens.min() < 30 and np.percentile(lens, 50) < 40 and lens.max() > 90


def test_far_tail_puts_its_mass_on_very_long_problems():
    """arith-tail: the arith-long body plus ~5 % of problems of 15..19 digits (150..191 tokens)."""
    r = random.Random(2)
    tail = get_env("arith-tail")
    specs = [tail.sample(r).spec for _ in range(4000)]
    lens = np.array([len(tail.demonstration(s, "steps")) for s in specs])
    assert np.percentile(lens, 50) < 40
    assert 0.03 < (lens >= 150).mean() < 0.08 and lens.max() > 180
    assert max(max(s["a"], s["b"]) for s in specs) < 2**64  # specs travel as msgpack ints
    for bad in [(1, 0.1), (30, 0.1), (10, 0.0), (10, 1.0)]:
        with pytest.raises(ValueError, match="far="):
            ArithEnv("x", 1, 24, tail=0.6, far=bad)
