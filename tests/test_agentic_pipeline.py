"""Multi-turn episodes in the pipeline: the engine continues a kept sequence (KV reused), the
worker's episode runner stores token-exact trajectories, the Rollout carries them (schema 2),
the scorer prices them, and the trainer's loss ignores observation tokens."""

from __future__ import annotations

import asyncio

import pytest
import torch

import policy
from bus.events import EventError, Rollout, SamplingParams, Task, decode, encode
from envs.episode import EpisodeLimits
from envs.sandbox import BashLimits
from policy.reward import rollout_cost
from rollout_worker.episodes import EpisodeRunner, PlainFormat, episode_spec
from rollout_worker.torch_engine import TorchEngine
from tests.helpers.agentic import CFG, TOK, bug_task, no_special_state
from trainer.learner import Learner, PackedSample
from trainer.loss import LossConfig


async def test_extend_reuses_the_kv_cache_and_matches_a_full_forward():
    """generate(keep) + extend(appended ids) gives the logprobs a teacher-forced forward of the
    whole sequence gives; the kept slot is not free until release."""
    eng = TorchEngine(CFG, slots=2, max_len=256, seed=1, eos_id=None)
    state = no_special_state(1)
    await eng.load_keyframe(state, 0, 0)
    sp = SamplingParams(max_tokens=12, temperature=1.0)
    prompt = TOK.encode("USER:\nhello\n", bos=True)
    try:
        g1 = await eng.generate(prompt, sp, seed=0, keep=True)
        assert g1.handle >= 0 and eng.free_slots == 1  # the slot stays with the sequence
        obs = TOK.encode("\nOBS: ok\n")
        g2 = await eng.extend(g1.handle, obs, sp)
        g3 = await eng.extend(g1.handle, [], sp)  # continue with nothing appended
        with pytest.raises(ValueError, match="no kept sequence"):
            await eng.extend(12345, obs, sp)
    finally:
        eng.release(g1.handle)
    assert eng.free_slots == 2
    with pytest.raises(ValueError, match="no kept sequence"):
        await eng.extend(g1.handle, obs, sp)
    model = policy.Transformer(CFG)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    comp = g1.completion_ids + obs + g2.completion_ids + g3.completion_ids
    ref = policy.sequence_logprobs(model, [prompt], [comp], policy.SamplingConfig()).logprobs[0]
    n1, no, n2 = len(g1.completion_ids), len(obs), len(g2.completion_ids)
    got = torch.tensor(g1.logprobs + g2.logprobs + g3.logprobs)
    want = torch.cat([ref[:n1], ref[n1 + no : n1 + no + n2], ref[n1 + no + n2 :]])
    assert torch.allclose(got, want, atol=2e-3), (got - want).abs().max()
    await eng.close()


async def test_three_turn_episode_ids_equal_the_tokenised_conversation():
    """A real 3-turn episode (three turns without an action: terminated by `format`): the stored
    ids are exactly the tokenisation of the whole conversation text; loss mask, logprobs,
    versions and sampling-mask rows mark the observation tokens; the Rollout round-trips."""
    eng = TorchEngine(CFG, slots=2, max_len=2048, seed=2, eos_id=TOK.eos_id)
    await eng.load_keyframe(no_special_state(2), 3, 0)
    runner = EpisodeRunner(eng, TOK, worker_id="w")
    limits = EpisodeLimits(max_turn_tokens=24, max_format_errors=3, command=BashLimits(wall_s=2.0))
    task = Task(
        task_id="ep1",
        env="swe",
        prompt="Fix calc.py.",
        spec=episode_spec(bug_task(), limits),
        sampling={"max_tokens": 24, "n": 1},
    )
    try:
        ro = await runner.run(task, SamplingParams(max_tokens=24, n=1), 0)
    finally:
        await eng.close()
    assert ro.turns == 3 and ro.termination == "format" and ro.tool_calls == 0
    ep = ro.episode
    assert ep["format_errors"] == 3 and ep["reward"] == 0.0
    turns = ep["turn_log"]
    assert [t["finish"] for t in turns] == ["length"] * 3
    # rebuild the conversation as text from its parts: prompt, each action, each observation
    fmt = PlainFormat()
    from envs.actions import format_error_observation, parse_action
    from envs.episode import SYSTEM_PROMPT

    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix calc.py."}]
    ids, mask = ro.completion_ids, ro.loss_mask
    spans, cur = [], [mask[0], 0]  # runs of equal mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != cur[0]:
            spans.append((cur[0], cur[1], i))
            if i < len(mask):
                cur = [mask[i], i]
    assert [m for m, _, _ in spans] == [1, 0, 1, 0, 1]
    actions = [TOK.decode(ids[a:b]) for m, a, b in spans if m == 1]
    text = fmt.prompt(msgs)
    for k, a in enumerate(actions):
        text += a
        if k < 2:
            text += fmt.observation(format_error_observation(parse_action(a)[1]), False)
    assert ro.prompt_ids + ro.completion_ids == TOK.encode(text, bos=True)
    obs = [i for i, m in enumerate(mask) if m == 0]
    assert all(ro.logprobs[i] == 0.0 and ro.token_versions[i] == -1 for i in obs)
    assert all(ro.token_versions[i] == 3 and ro.logprobs[i] < 0 for i, m in enumerate(mask) if m == 1)
    rows = policy.SamplingMask.from_wire(ro.sampling_mask)
    assert len(rows) == len(ids) and all(rows.row(i) is None for i in obs)
    assert ro.cost_tokens == sum(mask) == 3 * 24
    back = decode(encode(ro), Rollout)
    assert back.loss_mask == mask and back.turns == 3 and back.termination == "format"


def test_rollout_schema_and_mask_are_checked():
    base = dict(
        rollout_id="r-0",
        task_id="r",
        env="swe",
        sample_index=0,
        group_size=1,
        prompt="p",
        spec={},
        prompt_ids=[1],
        completion_ids=[5, 6, 7],
        completion_text="",
        logprobs=[-1.0, 0.0, -1.0],
        token_versions=[0, -1, 0],
        sampling={},
        sampling_mask={},
        quant={},
        finish_reason="stop",
        cost_tokens=2,
        wall_s=0.1,
        worker_id="w",
        loss_mask=[1, 0, 1],
        turns=2,
        tool_calls=1,
    )
    good = Rollout(**base)
    assert decode(encode(good), Rollout).loss_mask == [1, 0, 1]
    d = good.to_dict()
    assert d["schema"] == 2
    old = {**d, "schema": 1}
    import msgpack

    with pytest.raises(EventError, match="schema version 1.*before multi-turn episodes"):
        decode(msgpack.packb(old), Rollout)
    for bad, why in (
        (dict(loss_mask=[1, 0]), "loss_mask length"),
        (dict(loss_mask=[1, 2, 1]), r"loss_mask\[1\] = 2 is outside its bounds \(expected `int` <= 1\)"),
        (dict(token_versions=[0, 0, 0]), "-1 exactly on observation"),
        (dict(loss_mask=[], token_versions=[0, -1, 0]), "negative token_versions"),
        (dict(turns=0), r"turns = 0 is outside its bounds \(expected `int` >= 1\)"),
    ):
        with pytest.raises(EventError, match=why):
            decode(msgpack.packb({**d, **bad}), Rollout)


def test_episode_cost_units():
    assert rollout_cost("tokens", 72, 3.5, 4) == 72.0
    assert rollout_cost("tool_calls", 72, 3.5, 4) == 4.0
    assert rollout_cost("wall_s", 72, 3.5, 4) == 3.5
    with pytest.raises(ValueError, match="cost_unit"):
        rollout_cost("dollars", 1, 1.0, 1)


def _grads(learner: Learner, samples) -> torch.Tensor:
    learner.model.zero_grad(set_to_none=True)
    loss, _ = learner.loss(samples)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in learner.model.parameters() if p.grad is not None])


def test_trainer_loss_ignores_observation_tokens():
    """Gradient check: whatever the observation tokens' behaviour logprobs (which drive the IS
    weights) the gradient is the same; and it equals the gradient of the model tokens alone."""
    torch.manual_seed(0)
    cfg = policy.ModelConfig.tiny(vocab_size=TOK.vocab_size, max_seq_len=64)
    model = policy.Transformer(cfg)
    learner = Learner(
        model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig(is_mode="truncated", is_clip=5.0)
    )
    prompt = TOK.encode("ab", bos=True)
    comps = [TOK.encode("cdefghij"), TOK.encode("kl mnop\n")]  # two episodes of one group
    mask = [1, 1, 0, 0, 0, 1, 1, 1]
    with torch.no_grad():
        lps = policy.sequence_logprobs(model, [prompt] * 2, comps, policy.SamplingConfig()).logprobs.tolist()
    behav = [[x - 0.3 if m else 0.0 for x, m in zip(lp, mask)] for lp in lps]

    def group(behav, m=mask):
        return [
            PackedSample(
                f"r{i}", 0, float(1 - i), 1.0, 0, prompt, comps[i], behav[i], {}, {}, {}, loss_mask=m
            )
            for i in range(2)
        ]

    g0 = _grads(learner, group(behav))
    wild = [[x if m else -7.0 for x, m in zip(b, mask)] for b in behav]  # observation logprobs changed
    g1 = _grads(learner, group(wild))
    tol = 1e-5 * float(g0.abs().max())  # a tiny model's gradients are tiny
    assert g0.abs().max() > 0 and torch.allclose(g0, g1, rtol=0, atol=tol)
    # the same gradient from the model tokens alone: each run of model tokens as its own sample,
    # the observation tokens folded into its prompt; rewards (1, 1, 0, 0) give advantages +1/-1
    # as (1, 0) do, and the token-level mean is over the same 10 model tokens
    parts = []
    for i in range(2):
        c = comps[i]
        parts += [
            PackedSample(f"a{i}", 0, float(1 - i), 1.0, 0, prompt, c[:2], behav[i][:2], {}, {}, {}),
            PackedSample(f"b{i}", 0, float(1 - i), 1.0, 0, prompt + c[:5], c[5:], behav[i][5:], {}, {}, {}),
        ]
    g2 = _grads(learner, parts)
    assert torch.allclose(g0, g2, rtol=0, atol=1e-4 * float(g0.abs().max())), (g0 - g2).abs().max()
    g3 = _grads(learner, group(behav, None))
    assert (g0 - g3).abs().max() > 0.05 * g0.abs().max()  # the mask does change the loss


async def test_episode_task_through_worker_scorer_and_batcher(bus, fresh_server, tmp_path):
    """A multi-turn Task through the real worker handler, scorer and trainer batcher: one Rollout
    per episode (schema 2), the scorer's reward from the episode and its cost in model tokens,
    the learner's packed sample carrying the loss mask."""
    from bus import BusConfig
    from rollout_worker.config import WorkerConfig
    from rollout_worker.worker import Worker
    from scorer.config import ScorerConfig
    from scorer.service import Scorer
    from tests.helpers.trainer import trainer_config
    from trainer.batcher import Batcher, ConsumedIds
    from trainer.learner import pack

    eng = TorchEngine(CFG, slots=2, max_len=2048, seed=4, eos_id=TOK.eos_id)
    await eng.load_keyframe(no_special_state(4), 0, 0)
    w = Worker(WorkerConfig(bus=BusConfig(servers=[fresh_server.url]), worker_id="w1"), bus, engine=eng)
    limits = EpisodeLimits(max_turn_tokens=16, max_format_errors=2, command=BashLimits(wall_s=2.0))
    task = Task(
        task_id="epx",
        env="swe",
        prompt="Fix calc.py.",
        spec=episode_spec(bug_task(), limits),
        sampling={"max_tokens": 16, "n": 2},
    )
    await w.handle(task, ctx=None)
    await eng.close()
    assert w.rollouts == 2 and w.tasks_done == 1
    stop = asyncio.Event()
    scorer = Scorer(
        ScorerConfig(bus=BusConfig(servers=[fresh_server.url]), reward={"cost_unit": "tokens"}), bus
    )
    st = asyncio.create_task(scorer.run(stop, handle_signals=False))
    b = Batcher(
        bus,
        trainer_config(fresh_server.url, tmp_path, batch={"groups": 1, "group_size": 2}),
        ConsumedIds(),
        TOK.vocab_size,
    )
    await b.start()
    batch = await b.next_batch(0, max_wait_s=30)
    stop.set()
    await st
    assert batch is not None and sorted(batch.rollout_ids) == ["epx-0", "epx-1"]
    for s in batch.samples:
        assert s.scored.success == 0.0 and s.scored.cost == 32.0 and s.rollout.termination == "format"
        assert s.lag == 0 and "episode format" in s.scored.reason
    packed = pack(batch)
    assert all(
        p.loss_mask and sum(p.loss_mask) == 32 and len(p.loss_mask) == len(p.completion_ids) for p in packed
    )


async def test_weight_update_between_turns_is_recorded_per_token():
    """A new policy version lands while the first command runs: turn 1's tokens keep version 3,
    later turns' tokens carry 4; the kept KV cache goes on (no re-prefill of earlier turns)."""
    from envs.episode_pool import EpisodePool

    eng = TorchEngine(CFG, slots=1, max_len=2048, seed=5, eos_id=TOK.eos_id)
    await eng.load_keyframe(no_special_state(5), 3, 0)
    new_state = no_special_state(6)

    class UpdatingPool(EpisodePool):  # the real pool; a keyframe arrives during the first step
        async def step(self, ep, action, n_tokens=None):
            if ep.turns == 0:
                await eng.load_keyframe(new_state, 4, 0)
            return await super().step(ep, action, n_tokens)

    runner = EpisodeRunner(eng, TOK, pool=UpdatingPool(), worker_id="w")
    limits = EpisodeLimits(max_turn_tokens=8, max_format_errors=2, command=BashLimits(wall_s=2.0))
    task = Task(
        task_id="v",
        env="swe",
        prompt="Fix calc.py.",
        spec=episode_spec(bug_task(), limits),
        sampling={"max_tokens": 8, "n": 1},
    )
    try:
        ro = await runner.run(task, SamplingParams(max_tokens=8, n=1), 0)
    finally:
        await eng.close()
    model_versions = [v for v, m in zip(ro.token_versions, ro.loss_mask) if m]
    assert model_versions == [3] * 8 + [4] * 8
    assert eng.free_slots == 1  # the slot came back after the episode
