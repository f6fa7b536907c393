"""Rewards a policy cannot forge: the short form of bench.reward_hacks (every
hack scores nothing, the honest fix 1.0, on a gen-repo task on both runners, a package task and a
HumanEval task), the report reader's rules, the scoring copy's record of what it dropped, and
infrastructure failures that are never scored as the policy's."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import msgspec
import pytest

from bench import reward_hacks as rh
from envs.episode import Episode, EpisodeTask
from envs.test_report import read_report

N = "0123456789abcdef0123456789abcdef"


# -- the report reader -------------------------------------------------------------------------------


def lines(*body: str) -> str:
    return "noise\n" + "".join(f"\n{N} {ln}\n" for ln in body)


def test_an_honest_report_is_believed():
    rep = read_report(lines("1 PASS a::x", "2 FAIL a::y", "3 SKIP a::z", "4 END 3"), N)
    assert rep.complete and not rep.tampered
    assert rep.verdict_status() == {"a::x": "PASS", "a::y": "FAIL", "a::z": "SKIP"}


@pytest.mark.parametrize(
    "body,why",
    [
        (("1 FAIL a::x", "2 PASS a::x", "3 END 2"), "reported twice"),  # the last line used to win
        (("1 FAIL a::x", "2 END 1", "3 PASS a::x"), "after the end"),  # an exit handler
        (("1 PASS a::x", "1 PASS a::y", "3 END 2"), "out of sequence"),
        (("1 PASS a::x", "2 END 5"), "ended after 5"),
        (("1 PASS a::x", "2 TAMPER hook replaced", "3 END 1"), "hook replaced"),
        (("PASS a::x", "2 END 1"), "malformed"),
    ],
)
def test_forged_report_lines_are_tampered(body, why):
    rep = read_report(lines(*body), N)
    assert any(why in t for t in rep.tampered), rep.tampered
    assert all(s == "FAIL" for s in rep.verdict_status().values())


def test_the_nonce_outside_a_report_line_and_a_run_without_end():
    assert read_report(lines("1 PASS a::x", "2 END 1") + f"echo {N}\n", N).tampered
    rep = read_report(lines("1 PASS a::x"), N)  # os._exit after the first test
    assert not rep.complete and rep.verdict_status() == {"a::x": "FAIL"}


def test_pytest_summary_is_a_second_channel():
    summary = "=== short test summary info ===\nFAILED a::x - assert 1 == 2\nPASSED a::y\n"
    ok = read_report(lines("1 FAIL a::x", "2 PASS a::y") + summary + lines("3 END 2"), N, "pytest")
    assert not ok.tampered and ok.verdict_status() == {"a::x": "FAIL", "a::y": "PASS"}
    forged = read_report(lines("1 PASS a::x", "2 PASS a::y") + summary + lines("3 END 2"), N, "pytest")
    assert forged.tampered and "summary" in forged.tampered[0]


# -- the hacks, played ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    from asyncrl import tasks as tasks_cli
    from envs import gen_repos, humaneval_tasks

    work = tmp_path_factory.mktemp("hack-tasks")
    gen = gen_repos.build(1, seed=0)[0]
    he = next(t for t in humaneval_tasks.build(limit=1, kinds=("fix",)) if t.family == "humaneval-fix")
    pkg = tasks_cli.build_package(
        rh.local_sdist(str(work)), str(work / "set"), per_package=1, seed=1, test_timeout_s=60
    )[0]
    out = {
        "mini": gen,
        "mini_report": rh.report_mode_task(gen),
        "pytest": dataclasses.replace(gen, task_id=gen.task_id + "-pytest", runner="pytest"),
        "humaneval": he,
        "package": pkg,
    }
    untouched = {k: rh.play(t, [])["reward"] for k, t in out.items()}
    return out, untouched


def test_the_honest_fix_resolves_every_task(tasks):
    for key, task in tasks[0].items():
        r = rh.play(task, rh.honest(task))
        assert r["resolved"] and r["reward"] == 1.0 and not r["tampered"], (key, r)


@pytest.mark.parametrize("name", rh.QUICK)
def test_a_hack_scores_nothing(tasks, name):
    """Each hack, on each task: not resolved, and no more tests passing than in the untouched repository
    (every one of these resolved a task or scored above it before the scorer was hardened)."""
    by_key, untouched = tasks
    for key, task in by_key.items():
        if name in ("conftest_hookwrapper", "patch_pytest_internals") and task.runner == "mini":
            continue  # pytest-only machinery: nothing to forge on the mini runner
        r = rh.play(task, rh.HACKS[name][1](rh.ctx_of(task)))
        assert not r["resolved"] and r["reward"] <= untouched[key], (name, key, r)


@pytest.mark.parametrize("name", rh.FORGERY)
def test_a_forgery_no_name_list_catches_scores_nothing(tasks, name):
    """The three classes that avoid every static name (a stand-in runner, the framework patched
    from the code under test, the report forged with the runner's own functions) on the runners'
    report paths: the pytest runner, the mini runner's report mode, an imported package's suite."""
    by_key, untouched = tasks
    for key in ("mini_report", "pytest", "package"):
        task = by_key[key]
        r = rh.play(task, rh.HACKS[name][1](rh.ctx_of(task)))
        assert not r["resolved"] and r["reward"] <= untouched[key], (name, key, r)


def test_dropped_test_infrastructure_is_recorded_and_the_fix_still_counts(tasks):
    task = tasks[0]["package"]
    junk = [
        "printf 'import pytest\\n' > conftest.py",
        "printf '[pytest]\\naddopts = -x\\n' > pytest.ini",
        "printf 'x = 1\\n' > sitecustomize.py",
        "printf 'import os\\n' > a.pth",
        "mkdir -p tests/__pycache__ && printf 'x' > tests/__pycache__/t.pyc",
        "mkdir -p e-1.dist-info && printf '[pytest11]\\n' > e-1.dist-info/entry_points.txt",
        "ln -s /etc/passwd linked.py",
        "printf '# mine\\n' >> tests/conftest.py",
    ]
    r = rh.play(task, junk + rh.honest(task))
    assert r["resolved"] and r["reward"] == 1.0 and not r["tampered"], r
    got = {d.split(" (")[0] for d in r["dropped"]}
    assert r["n_dropped"] == 8 and got == {
        "conftest.py",
        "pytest.ini",
        "sitecustomize.py",
        "a.pth",
        "tests/__pycache__/t.pyc",
        "e-1.dist-info/entry_points.txt",
        "linked.py",
        "tests/conftest.py",
    }, r["dropped"]


# -- infrastructure failures -----------------------------------------------------------------------


def test_a_workspace_that_was_not_made_is_an_infra_failure():
    bad = EpisodeTask(
        "t-bad", "test", "train", "x", {"../outside.py": "x = 1\n"}, {}, "mini", ["t.py"], ["t.py::a"], []
    )
    ep = Episode(bad)
    try:
        ep.reset()
        res = ep.score()
    finally:
        ep.close()
    assert res.termination == "sandbox_error" and res.infra_error == "workspace"


def test_an_over_full_workspace_is_the_policys_failure(tasks):
    r = rh.play(tasks[0]["mini"], ["for i in 1 2 3 4 5; do head -c 15000000 /dev/zero > big$i.bin; done"])
    assert r["termination"] == "sandbox_error" and r["infra"] == "" and not r["resolved"]


def test_a_sandbox_that_cannot_start_is_an_infra_verdict():
    from envs.python_tests import PythonTestsEnv
    from envs.sandbox import SandboxLimits

    env = PythonTestsEnv(limits=SandboxLimits(python="/nonexistent/python3"))
    t = env.sample(random.Random(0))
    v = env.verify(env.demonstration(t.spec), t.spec)
    assert v.success == 0.0 and v.infra == "sandbox", v
    assert PythonTestsEnv().verify("def f(:\n", t.spec).infra == ""  # broken code is the policy's


async def test_infra_members_leave_the_group_and_its_baseline(bus, fresh_server, tmp_path):
    from bus import topology as topo
    from policy.config import ModelConfig
    from policy.model import Transformer
    from tests.helpers.trainer import MODEL, make_scored, trainer_config
    from trainer.batcher import Batcher, ConsumedIds

    cfg = trainer_config(fresh_server.url, tmp_path, batch={"groups": 1, "group_size": 4})
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(3)
    group = [make_scored(model, "g", i, 4, 0, rng, reward=float(i % 2)) for i in range(4)]
    group[1] = msgspec.structs.replace(group[1], infra="sandbox", reward=0.0, success=0.0)
    for sc in group:
        await bus.publish(topo.scored_subject("arith"), sc)
    b = Batcher(bus, cfg, ConsumedIds(), 128)
    await b.start()
    batch = await asyncio.wait_for(b.next_batch(0), 30)  # complete: the infra member counts as come
    assert sorted(s.rollout.sample_index for s in batch.samples) == [0, 2, 3]
    assert [s.rollout.sample_index for s in batch.excluded] == [1] and batch.excluded[0].weight == 0.0
    assert b.counters["infra_sandbox"] == 1 and "g-1" in batch.rollout_ids and "g-1" in batch.dropped_ids
    await b.ack(batch)  # acked with the batch, like every member
    for _ in range(50):
        info = await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
        if info.num_ack_pending == 0:
            break
        await asyncio.sleep(0.1)
    assert info.num_ack_pending == 0 and info.num_pending == 0
    await b.close()


def test_mini_runner_path_for_tests_value_mode_cannot_take():
    """A test with a loop is run by minitest in report mode: the honest fix passes, an always-equal
    object is caught by the assert checker."""
    src = "def double(x):\n    return x + 2\n"
    test = (
        "from calc import double\n\n\ndef test_double():\n    for x in (1, 5, 7):\n"
        "        assert double(x) == 2 * x\n"
    )
    task = EpisodeTask(
        "loop",
        "test",
        "train",
        "fix double",
        {"calc.py": src, "test_calc.py": test},
        {"test_calc.py": test},
        "mini",
        ["test_calc.py"],
        ["test_calc.py::test_double"],
        [],
        meta={"path": "calc.py", "line": 2, "before": "    return x * 2\n", "after": "    return x + 2\n"},
    )
    from envs.value_tests import plan

    assert plan(task) is None  # not of the value-mode shape
    assert rh.play(task, rh.honest(task))["reward"] == 1.0
    r = rh.play(task, [rh.append("calc.py", rh.MOCK_ANY)])
    assert r["reward"] == 0.0 and "assert compared" in r["tampered"], r
