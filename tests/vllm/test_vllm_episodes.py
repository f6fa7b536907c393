"""Multi-turn episodes on the vLLM engine (`make test-vllm`): generate(keep=True) / extend / release
continue a sequence from its exact ids (the earlier turns' KV found in vLLM's prefix cache), stop
sequences end a turn exactly, and the episode runner's 3-turn trajectory is token-exact with the
behaviour logprobs of a teacher-forced forward of the whole sequence.

One engine for the module: vLLM takes about a minute to start on a small CPU box."""

from __future__ import annotations

import pytest
import pytest_asyncio
import torch

pytest.importorskip("vllm")

import policy  # noqa: E402
from bus.events import SamplingParams, Task  # noqa: E402
from envs.actions import format_error_observation, parse_action  # noqa: E402
from envs.episode import SYSTEM_PROMPT, EpisodeLimits  # noqa: E402
from envs.sandbox import BashLimits  # noqa: E402
from rollout_worker.episodes import EpisodeRunner, PlainFormat, episode_spec  # noqa: E402
from rollout_worker.sections import EngineSection  # noqa: E402
from tests.helpers.agentic import CFG, TOK, bug_task, no_special_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ATOL, RTOL = 0.08, 0.05  # bf16 vLLM kernels vs policy's fp32 forward on the same bf16 weights
STATE = no_special_state(2)  # never samples pad/bos/eos: every turn ends by length


def teacher_forced(prompt, completion) -> torch.Tensor:
    model = policy.Transformer(CFG).eval()
    model.load_state_dict({k: v.float() for k, v in STATE.items()}, strict=False)
    return policy.sequence_logprobs(model, [prompt], [completion], policy.SamplingConfig()).logprobs[0]


@pytest_asyncio.fixture(scope="module")
async def engine():
    from rollout_worker.vllm_engine import VLLMEngine

    eng = VLLMEngine(
        EngineSection(kind="vllm", slots=2, max_len=2048, seed=0),
        model_config=CFG.to_dict(),
        eos_id=TOK.eos_id,
        enforce_eager=True,
    )
    await eng.load_keyframe(STATE, version=3, epoch=0)
    yield eng
    await eng.close()


async def test_three_turn_episode_is_token_exact_on_vllm(engine):
    """A real 3-turn episode (no action in any turn: terminated by `format`) on vLLM: the stored ids
    are exactly prompt + each turn's tokens + each observation's tokens (the tokenisation of the
    whole conversation), loss mask 0 / logprob 0 / version -1 on observation tokens, and the model
    tokens' logprobs are a teacher-forced forward's over the whole sequence (so each continuation
    really ran after the earlier turns and the observation), with the prefix cache hit."""
    runner = EpisodeRunner(engine, TOK, worker_id="w")
    limits = EpisodeLimits(max_turn_tokens=24, max_format_errors=3, command=BashLimits(wall_s=2.0))
    task = Task(
        task_id="ep-vllm",
        env="swe",
        prompt="Fix calc.py.",
        spec=episode_spec(bug_task(), limits),
        sampling={"max_tokens": 24, "n": 1},
    )
    ro = await runner.run(task, SamplingParams(max_tokens=24, n=1), 0)
    assert ro.turns == 3 and ro.termination == "format", ro.episode
    assert [t["finish"] for t in ro.episode["turn_log"]] == ["length"] * 3
    ids, mask = ro.completion_ids, ro.loss_mask
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    assert [m for m, _, _ in runs] == [1, 0, 1, 0, 1] and all(b - a == 24 for m, a, b in runs if m == 1)
    # the expected ids, built from the parts: prompt, each turn's tokens, each observation's tokens
    fmt = PlainFormat()
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix calc.py."}]
    turns = [ids[a:b] for m, a, b in runs if m == 1]
    want = TOK.encode(fmt.prompt(msgs), bos=True)
    text = fmt.prompt(msgs)
    for k, t in enumerate(turns):
        want += t
        text += TOK.decode(t)
        if k < 2:
            obs = fmt.observation(format_error_observation(parse_action(TOK.decode(t))[1]), False)
            want += TOK.encode(obs)
            text += obs
    assert ro.prompt_ids + ro.completion_ids == want == TOK.encode(text, bos=True)
    obs_at = [i for i, m in enumerate(mask) if m == 0]
    model_at = [i for i, m in enumerate(mask) if m == 1]
    assert all(ro.logprobs[i] == 0.0 and ro.token_versions[i] == -1 for i in obs_at)
    assert all(ro.token_versions[i] == 3 for i in model_at)
    rows = policy.SamplingMask.from_wire(ro.sampling_mask)
    assert len(rows) == len(ids) and all(rows.row(i) is None for i in obs_at)
    ref = teacher_forced(ro.prompt_ids, ro.completion_ids)
    got = torch.tensor([ro.logprobs[i] for i in model_at])
    torch.testing.assert_close(got, ref[model_at], atol=ATOL, rtol=RTOL)
    # the third turn's request found the earlier turns' KV blocks in the prefix cache
    assert engine.last_cached_tokens >= len(ro.prompt_ids) // 2, engine.last_cached_tokens
    assert len(engine.kept) == 0  # the runner released its sequence


async def test_extend_continues_from_the_exact_ids_and_checks_handles(engine):
    sp = SamplingParams(max_tokens=10, temperature=1.0)
    prompt = TOK.encode("USER:\nhello\n", bos=True)
    g1 = await engine.generate(prompt, sp, seed=5, keep=True)
    obs = TOK.encode("\nOBS: ok\n")
    try:
        assert g1.handle >= 0 and (
            engine.kept._kept[g1.handle].ids == prompt + g1.completion_ids  # noqa: SLF001
        )
        g2 = await engine.extend(g1.handle, obs, sp)
        g3 = await engine.extend(g1.handle, [], sp)  # nothing appended: generation goes on
        assert g2.handle == g3.handle == g1.handle
        with pytest.raises(ValueError, match="no kept sequence"):
            await engine.extend(12345, obs, sp)
        with pytest.raises(ValueError, match="out of range"):
            await engine.extend(g1.handle, [10**6], sp)
    finally:
        engine.release(g1.handle)
    with pytest.raises(ValueError, match="no kept sequence"):
        await engine.extend(g1.handle, obs, sp)
    comp = g1.completion_ids + obs + g2.completion_ids + g3.completion_ids
    ref = teacher_forced(prompt, comp)
    n1 = len(g1.completion_ids)
    at = list(range(n1)) + list(range(n1 + len(obs), len(comp)))
    torch.testing.assert_close(
        torch.tensor(g1.logprobs + g2.logprobs + g3.logprobs), ref[at], atol=ATOL, rtol=RTOL
    )


async def test_stop_sequence_ends_the_completion_right_after_its_first_match(engine):
    prompt = TOK.encode("USER:\nstop here\n", bos=True)
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    full = await engine.generate(prompt, greedy, seed=0)
    assert full.finish_reason == "length"
    stop = full.completion_ids[20:22]
    first = next(e for e in range(2, 41) if full.completion_ids[e - 2 : e] == stop)
    cut = await engine.generate(prompt, greedy, seed=0, stop_seqs=[stop])
    assert cut.finish_reason == "stop_seq" and cut.completion_ids == full.completion_ids[:first]
    assert len(cut.logprobs) == len(cut.token_versions) == first
    assert policy.SamplingMask.from_wire(cut.sampling_mask).counts.size == first
