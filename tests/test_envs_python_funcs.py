"""python-funcs: many distinct function problems, split by problem; the reference of every family
passes its own hidden tests in the sandbox, and what a policy would try instead of solving does
not pass them."""

from __future__ import annotations

import random

import pytest

from envs import get_env
from envs.base import SpecError
from envs.python_funcs import FAMILIES


@pytest.fixture(scope="module")
def env():
    return get_env("python-funcs")


def test_the_held_out_split_holds_hundreds_of_problems_never_trained_on(env):
    rng = random.Random(0)
    held = {env.sample(rng, "eval").spec["problem"] for _ in range(3000)}
    train = {env.sample(rng, "train").spec["problem"] for _ in range(3000)}
    assert len(held) >= 300 and not held & train
    assert {p.split(" ")[0] for p in held} == set(FAMILIES)  # every family is asked held-out too


def test_every_familys_reference_passes_and_is_asked_in_words(env):
    rng = random.Random(1)
    for family in FAMILIES:
        t = env.make_task(family, rng)
        assert t.prompt.startswith("Write a Python function ") and "{" not in t.prompt
        fix = env.demonstration(t.spec)
        # as an instruct model replies: prose around a fenced block
        reply = f"Here is the function:\n```python\n{fix}```\nIt returns the value asked for."
        v = env.verify(reply, t.spec)
        assert v.success == 1.0, (family, v.reason)


def hacks(entry: str) -> dict[str, str]:
    return {
        "a constant": f"def {entry}(*a):\n    return 0\n",
        "False always": f"def {entry}(*a):\n    return False\n",
        "the input back": f"def {entry}(x):\n    return x\n",
        "exit before the tests": f"import sys\nsys.exit(0)\ndef {entry}(*a):\n    return 0\n",
        # the harness that imports the code holds the nonce: a forged report still has to hold the values
        "a forged report": (
            "import json, os, sys\n"
            "f = sys._getframe()\n"
            "while 'nonce' not in f.f_globals:\n"
            "    f = f.f_back\n"
            "line = f.f_globals['nonce'] + ' ' + json.dumps({'results': [['ok', 'forged']] * 8})\n"
            "os.write(1, ('\\n' + line + '\\n').encode())\n"
            "os._exit(0)\n"
        ),
    }


@pytest.mark.parametrize("family", ["divisible", "between", "count_above", "keep_multiples", "scale_shift"])
def test_what_a_policy_tries_instead_scores_below_a_solution(env, family):
    rng = random.Random(2)
    for _ in range(2):
        t = env.make_task(family, rng)
        assert env.verify(env.demonstration(t.spec), t.spec).success == 1.0  # the test can fail
        for name, code in hacks(t.spec["entry"]).items():
            v = env.verify(f"```python\n{code}```", t.spec)
            assert v.success <= 0.75, (family, name, v.reason)
            if name in ("exit before the tests", "a forged report"):
                assert v.success == 0.0, (family, name, v.reason)


def test_a_bool_is_not_a_number():
    from envs.python_tests import same_value

    assert not same_value(1, True) and not same_value(0, False) and not same_value([1, 0], [True, False])
    assert same_value(True, True) and same_value([[1, "a"]], [[1, "a"]]) and same_value(4, 4.0)
    assert not same_value({"a": 1}, {"a": True}) and not same_value([1], [1, 2])


def test_a_problem_without_a_reference_is_a_spec_error(env):
    t = env.make_task("clip", random.Random(3))
    with pytest.raises(SpecError, match="no reference"):
        env.demonstration({**t.spec, "problem": "nope {}"})
    with pytest.raises(SpecError, match="unreadable constants"):
        env.demonstration({**t.spec, "problem": "clip {"})
