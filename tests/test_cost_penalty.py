"""One λ per group (stamped at feed time, carried Task -> Rollout -> Scored, recorded per
group), the penalty modes that keep success first and the λ schedules (ramp, budget: their
formulas in policy/reward.py, KV in trainer/lambda_control.py). Bus tests run a real nats-server
and a real Scorer."""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest
import torch

from bus import BusConfig
from bus import topology as topo
from bus.control import format_lambda, parse_lambda
from bus.events import EventError, Rollout, Task, decode, encode
from envs import get_env
from policy import ModelConfig, SamplingConfig, Transformer, sequence_logprobs
from policy.reward import budget_step, price, ramp_lambda, trained_rewards
from scorer.config import ScorerConfig
from scorer.service import Scorer
from tests.helpers.trainer import trainer_config
from tests.test_scorer_process import scored_events
from tests.test_trainer_feed import wait_tasks
from trainer import lambda_control
from trainer.config import TrainerConfig
from trainer.feeding import TaskFeeder
from trainer.learner import Learner, PackedSample
from trainer.loss import LossConfig, group_advantages


def member(task: Task, i: int, text: str) -> Rollout:
    """A completion of `task` as the worker builds it (rollout_worker/worker.py: with the task's λ)."""
    n = len(text) + 1
    return Rollout(
        rollout_id=f"{task.task_id}-{i}",
        task_id=task.task_id,
        env=task.env,
        sample_index=i,
        group_size=task.sampling["n"],
        prompt=task.prompt,
        spec=task.spec,
        prompt_ids=[1, 2, 3],
        completion_ids=[5] * n,
        completion_text=text,
        logprobs=[-0.1] * n,
        token_versions=[0] * n,
        sampling=task.sampling,
        sampling_mask={},
        quant={},
        finish_reason="stop",
        cost_tokens=n,
        wall_s=0.01,
        worker_id="w",
        lambda_=task.lambda_,
    )


async def until(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


# -- one λ per group -------------------------------------------------------------------------------


async def test_a_group_scored_while_lambda_changes_in_kv_carries_one_lambda(bus, tmp_path):
    await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.01))
    feeder = TaskFeeder(
        bus, trainer_config(bus.cfg.servers[0], tmp_path, tasks={"envs": ["arith"]}, batch={"group_size": 2})
    )
    await feeder.publish(1)
    [task] = await wait_tasks(bus, 1)
    assert task.lambda_ == 0.01  # stamped at feed time
    env = get_env("arith")
    right = env.demonstration(task.spec, "steps")
    stop = asyncio.Event()
    scorer = Scorer(ScorerConfig(bus=BusConfig(servers=bus.cfg.servers), run={"heartbeat_s": 0.2}), bus=bus)
    run = asyncio.create_task(scorer.run(stop, handle_signals=False))
    try:
        await bus.publish(topo.rollout_subject("arith"), member(task, 0, right))
        first = await scored_events(bus, 1)
        await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.05))  # λ moves while the group is scored
        await until(lambda: scorer.lam == 0.05)
        await bus.publish(topo.rollout_subject("arith"), member(task, 1, "a longer wrong answer #1"))
        old = member(task, 2, right)
        old.lambda_ = None  # an older worker's rollout: no λ on it
        await bus.publish(topo.rollout_subject("arith"), old)
        rest = await scored_events(bus, 2)
    finally:
        stop.set()
        await run
    s = {**first, **rest}
    a, b = s[f"{task.task_id}-0"], s[f"{task.task_id}-1"]
    assert a.lambda_ == b.lambda_ == 0.01  # one λ for the group
    assert b.penalty == pytest.approx(0.01 * b.cost) and b.reward == pytest.approx(b.success - 0.01 * b.cost)
    assert s[f"{task.task_id}-2"].lambda_ == 0.05  # without one: the live λ, as before
    assert decode(encode(a), type(a)).get_rollout().lambda_ == 0.01


async def test_feeder_stamps_each_group_with_the_kv_lambda_of_its_time(bus, tmp_path):
    feeder = TaskFeeder(
        bus, trainer_config(bus.cfg.servers[0], tmp_path, tasks={"envs": ["arith"]}, batch={"group_size": 2})
    )
    await feeder.publish(1)  # no λ in KV yet: none stamped
    await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.002))
    await feeder.publish(1)
    await bus.kv_put(topo.KEY_LAMBDA, b"not a number")  # a typo: the last good λ stays
    await feeder.publish(1)
    await bus.kv_put(topo.KEY_LAMBDA, format_lambda(0.0))
    await feeder.publish(1)
    tasks = await wait_tasks(bus, 4)
    assert [t.lambda_ for t in sorted(tasks, key=lambda t: t.created_at)] == [None, 0.002, 0.002, 0.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5, True, "0.1"])
def test_a_bad_lambda_on_a_task_or_rollout_is_refused_by_name(bad):
    t = Task(task_id="t", env="arith", prompt="1+1=")
    d = t.to_dict() | {"lambda_": bad}
    with pytest.raises(EventError, match="lambda_"):
        decode(__import__("msgpack").packb(d), Task)
    r = member(Task(task_id="t", env="arith", prompt="p", sampling={"n": 2}), 0, "#2")
    rd = r.to_dict() | {"lambda_": bad}
    with pytest.raises(EventError, match="lambda_"):
        decode(__import__("msgpack").packb(rd), Rollout)
    from bus.events import SamplingParams
    from envs.feeder import make_tasks

    if not isinstance(bad, (bool, str)):  # the feeder refuses it before anything is sent
        with pytest.raises(EventError, match="lambda_"):
            make_tasks("arith", 1, SamplingParams(), random.Random(0), lambda_=bad)


def test_older_events_without_lambda_still_decode():
    import msgpack

    t = Task(task_id="t", env="arith", prompt="p", sampling={"n": 2})
    d = t.to_dict()
    del d["lambda_"]
    assert decode(msgpack.packb(d), Task).lambda_ is None
    rd = member(t, 0, "#2").to_dict()
    del rd["lambda_"]
    assert decode(msgpack.packb(rd), Rollout).lambda_ is None


# -- penalty modes ---------------------------------------------------------------------------------


def _group(success, cost, lam=0.01, shaping=0.0):
    """A group as the scorer prices it: its members' parts and prices (policy/reward.price)."""
    n = len(success)
    s, c = np.array(success, dtype=np.float64), np.array(cost, dtype=np.float64)
    lam_a, shaping_a = np.full(n, lam), np.full(n, shaping)
    r = np.array([price(*x)[1] for x in zip(s, c, lam_a, shaping_a)])
    return dict(reward=r, score=s, success=s, cost=c, lam=lam_a, shaping=shaping_a, group=np.zeros(n, int))


def rewards(g, mode, cap=0.25, live=None):
    return torch.from_numpy(trained_rewards(mode, **g, cap=cap, live=live))


def test_linear_is_the_scorers_reward_unchanged():
    g = _group([1, 0, 1], [10, 40, 20])
    assert np.array_equal(trained_rewards("linear", **g), g["reward"])


def test_success_only_a_group_where_all_fail_has_no_cost_signal():
    g = _group([0, 0, 0, 0], [5, 10, 30, 60], shaping=0.0)
    gi = torch.from_numpy(g["group"])
    assert torch.equal(group_advantages(rewards(g, "success_only"), gi), torch.zeros(4))
    assert group_advantages(rewards(g, "linear"), gi).abs().sum() > 0  # linear: failures ranked by cost
    # a mixed group: successes pay λ·cost, failures nothing; overlong shaping is kept for everyone
    g = _group([1, 0, 1, 0], [10, 40, 20, 40], shaping=0.1)
    out = rewards(g, "success_only")
    torch.testing.assert_close(out, torch.tensor([1 - 0.1 - 0.1, -0.1, 1 - 0.2 - 0.1, -0.1], dtype=out.dtype))


def test_group_normalised_is_bounded_so_success_always_outranks_failure():
    # a λ so large that linear would make the long success worse than every failure
    g = _group([1, 1, 0, 0], [100, 10, 5, 100], lam=0.05)
    assert g["reward"][0] < g["reward"][2]
    out = rewards(g, "group_normalised", cap=0.25)
    assert out[:2].min() > out[2:].max()  # success first
    assert out[1] > out[0] and out[2] > out[3]  # cost ranks within equal success
    assert (out - torch.from_numpy(g["success"])).abs().max() <= 0.25 + 1e-6
    # a small λ: the scale is the linear penalty at the group's mean cost, spread by the z-score
    out = rewards(_group([1, 1], [10, 30], lam=0.001), "group_normalised", cap=0.25)
    torch.testing.assert_close(out, torch.tensor([1 + 0.02, 1 - 0.02], dtype=out.dtype), rtol=0, atol=1e-5)
    # equal cost in a group, or λ = 0: no penalty at all
    g = _group([1, 0], [10, 10])
    torch.testing.assert_close(rewards(g, "group_normalised"), torch.from_numpy(g["success"]))


def test_group_normalised_takes_statistics_over_live_members_per_group():
    g = _group([1, 1, 1, 1, 1], [10, 30, 1000, 10, 30], lam=0.001)
    g["group"] = np.array([0, 0, 0, 1, 1])
    out = rewards(g, "group_normalised", live=np.array([True, True, False, True, True]))
    torch.testing.assert_close(out[[0, 1]], out[[3, 4]])  # the dead 1000-token member: no effect


def test_unknown_penalty_and_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown penalty"):
        trained_rewards("quadratic", **_group([1], [1]))
    for kw in (
        dict(penalty="quadratic"),
        dict(penalty_cap=0.5),
        dict(penalty_cap=0.0),
        dict(schedule="ramp"),
        dict(schedule="budget", budget_tokens=10.0),
        dict(schedule="budget", budget_lr=0.01),
        dict(target=-1.0),
        dict(target=float("nan")),
        dict(schedule="sometimes"),
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            TrainerConfig(cost=kw)


def _tiny_samples(success, cost_tokens, lam=0.01):
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig.tiny(vocab_size=97, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
    )
    rng = random.Random(0)
    out = []
    for i, (sc, T) in enumerate(zip(success, cost_tokens)):
        prompt, comp = [1, 5, 7], [rng.randrange(2, 97) for _ in range(T)]
        with torch.no_grad():
            lp = sequence_logprobs(model, [prompt], [comp], SamplingConfig(temperature=1.0)).logprobs[0]
        out.append(
            PackedSample(
                f"r{i}",
                0,
                sc - lam * T,
                1.0,
                0,
                prompt,
                comp,
                [float(x) for x in lp],
                {"temperature": 1.0},
                {},
                {},
                success=sc,
                cost=float(T),
                lambda_=lam,
                score=sc,
            )
        )
    return model, out


@pytest.mark.parametrize("mode", ["linear", "success_only"])
def test_success_only_gives_a_group_of_failures_no_gradient_in_the_learner(mode):
    model, samples = _tiny_samples([0.0, 0.0, 0.0], [3, 8, 14])
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig(), penalty=mode)
    learner.loss(samples, backward=True)
    norm = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
    assert (norm == 0.0) == (mode == "success_only")


# -- λ schedules -----------------------------------------------------------------------------------


def test_budget_lambda_rises_over_the_target_and_falls_to_zero_under_it():
    lam, path = 0.0, []
    for tokens in (200, 200, 150, 100, 50, 50, 50, 50, 50, 50):  # budget 100 tokens per answer
        lam = budget_step(lam, tokens, 100.0, 0.01)
        path.append(lam)
    assert path[:3] == pytest.approx([0.01, 0.02, 0.025])
    assert path[3] == pytest.approx(0.025)  # at the budget: unchanged
    assert path[4] < path[3] and path[-1] == 0.0 and min(path) >= 0.0


def test_ramp_goes_from_zero_to_the_target_over_k_versions():
    assert [ramp_lambda(0.02, 4, v) for v in (0, 1, 2, 4, 9)] == pytest.approx([0.0, 0.005, 0.01, 0.02, 0.02])


async def test_budget_schedule_moves_kv_lambda_from_measured_tokens(bus):
    cfg = TrainerConfig(cost={"schedule": "budget", "budget_tokens": 20.0, "budget_lr": 0.01})
    sched = lambda_control.LambdaSchedule(cfg)
    assert await sched.start(bus, 0) == {}  # budget starts from KV (absent: 0)
    m = await sched.after_version(bus, 1, 40.0)  # twice the budget: λ up by budget_lr
    assert m["lambda_next"] == pytest.approx(0.01) and m["lambda_prev"] == 0.0 and m["budget_ratio"] == 2.0
    assert parse_lambda(await bus.kv_get(topo.KEY_LAMBDA)) == pytest.approx(0.01)
    m = await sched.after_version(bus, 2, 5.0)  # under the budget: down
    assert m["lambda_next"] == pytest.approx(0.0025)
    m = await sched.after_version(bus, 3, 5.0)  # floored at 0
    assert m["lambda_next"] == 0.0 and await bus.kv_get(topo.KEY_LAMBDA) == b"0.0"
    ramp = lambda_control.LambdaSchedule(
        TrainerConfig(cost={"schedule": "ramp", "target": 0.02, "ramp_versions": 4})
    )
    assert (await ramp.start(bus, 0))["lambda_next"] == 0.0
    assert (await ramp.after_version(bus, 2, 10.0))["lambda_next"] == pytest.approx(0.01)
    assert parse_lambda(await bus.kv_get(topo.KEY_LAMBDA)) == pytest.approx(0.01)
    assert await lambda_control.LambdaSchedule(TrainerConfig()).after_version(bus, 3, 99.0) == {}
    assert math.isclose(parse_lambda(await bus.kv_get(topo.KEY_LAMBDA)), 0.01)  # fixed: untouched


async def test_the_worker_carries_its_tasks_lambda_onto_every_rollout(bus, fresh_server):
    from bus.weights.publisher import WeightPublisher
    from rollout_worker.worker import Worker
    from tests.helpers.worker import CFG, read_stream, states_for, worker_cfg

    await WeightPublisher(bus, epoch=1, trainer_id="t").publish_keyframe(states_for(1, seed=3)[0], 0, CFG)
    worker, stop = Worker(worker_cfg(fresh_server.url), bus), asyncio.Event()
    run = asyncio.create_task(worker.run(stop, handle_signals=False))
    sampling = {"max_tokens": 6, "n": 2, "temperature": 1.0}
    for tid, lam in (("priced", 0.003), ("older", None)):
        await bus.publish(
            topo.task_subject("arith"),
            Task(
                task_id=tid,
                env="arith",
                prompt="12+30=",
                spec={"answer": "42"},
                sampling=sampling,
                lambda_=lam,
            ),
        )
    try:
        await until(lambda: worker.tasks_done == 2, timeout=60)
    finally:
        stop.set()
        await run
    got = {r.rollout_id: r.lambda_ for r in await read_stream(bus, topo.ROLLOUTS, Rollout)}
    assert got == {"priced-0": 0.003, "priced-1": 0.003, "older-0": None, "older-1": None}
