"""Tasks for an instruct model go out through its chat template ([trainer] chat_template = true):
the feeder renders each prompt as the template's user turn, the worker's tokenisation of it equals
transformers' apply_chat_template (one bos, markup as special ids); the arith-chat env scores the
model's own chat answers; a template-less tokenizer is refused before start."""

from __future__ import annotations

import random

import pytest
import transformers

from asyncrl import config_check
from bus import topology as topo
from bus.events import Task, decode
from envs import get_env
from envs.base import SpecError
from envs.feeder import chat_renderer, make_tasks
from kernel.config import ConfigError
from policy import load_hf_tokenizer, load_tokenizer
from tests.helpers.bpe import chat_tokenizer_folder
from trainer.config import TrainerConfig
from trainer.feeding import TaskFeeder


async def test_feeder_renders_prompts_through_the_chat_template(bus, tmp_path):
    chat_tokenizer_folder(tmp_path)  # ChatML, bos = <|im_start|> (as SmolLM2's)
    cfg = TrainerConfig(
        policy={"tokenizer": str(tmp_path)},
        tasks={
            "chat_template": True,
            "envs": ["arith-chat"],
            "sampling": {"temperature": 0.7, "max_tokens": 24},
        },
        batch={"group_size": 2},
    )
    ids = await TaskFeeder(bus, cfg).publish(3)
    msgs = await (await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)).fetch(10, timeout=2)
    tasks = [decode(m.data, Task) for m in msgs]
    assert sorted(t.task_id for t in tasks) == sorted(ids)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = load_hf_tokenizer(tmp_path)
    for t in tasks:
        question = f"What is {t.spec['a']} + {t.spec['b']}? Answer with the number."
        chat = [{"role": "user", "content": question}]
        assert t.prompt == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if not isinstance(want, list) else want
        got = tok.encode(t.prompt, bos=True)  # what the worker does with Task.prompt
        assert got == want and got.count(tok.bos_id) == 2  # the user turn's and the assistant's
        await msgs[tasks.index(t)].ack()
    # without the flag the prompt goes out as the env wrote it, and plain text still gets its bos
    plain = make_tasks(
        "arith-chat",
        1,
        TaskFeeder(bus, TrainerConfig(policy={"tokenizer": str(tmp_path)})).sampling(),
        random.Random(0),
    )[0]
    assert plain.prompt.startswith("What is ")
    assert tok.encode(plain.prompt, bos=True)[0] == tok.bos_id


def test_chat_template_without_a_template_is_refused(tmp_path):
    with pytest.raises(ValueError, match="chat_template"):
        TrainerConfig(tasks={"chat_template": True})  # the char tokenizer has no template
    chat_tokenizer_folder(tmp_path, template=None)
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        chat_renderer(load_tokenizer(str(tmp_path)))
    conf = {
        "up": {"workers": 1, "steps": 3},
        "worker": {"admission": {"max_lag": 4}, "engine": {"tokenizer": str(tmp_path)}},
        "scorer": {},
        "trainer": {
            "batch": {"max_lag": 4},
            "policy": {"tokenizer": str(tmp_path)},
            "tasks": {"chat_template": True},
        },
    }
    with pytest.raises(ConfigError, match=r"\[trainer.tasks\] chat_template = true: .*chat template"):
        config_check.cross_check(config_check.resolve(conf, environ={}))
    missing = str(tmp_path / "nope")
    conf["trainer"]["policy"]["tokenizer"] = conf["worker"]["engine"]["tokenizer"] = missing
    with pytest.raises(ConfigError, match=r"\[trainer.tasks\] chat_template = true: no tokenizer.json"):
        config_check.cross_check(config_check.resolve(conf, environ={}))
    chat_tokenizer_folder(tmp_path)  # with a template: passes
    conf["trainer"]["policy"]["tokenizer"] = conf["worker"]["engine"]["tokenizer"] = str(tmp_path)
    config_check.cross_check(config_check.resolve(conf, environ={}))


def test_arith_chat_scores_chat_answers():
    env = get_env("arith-chat")
    rng = random.Random(0)
    specs = [env.sample(rng) for _ in range(50)]
    assert all(0 <= s.spec["a"] <= 9 and 0 <= s.spec["b"] <= 9 for s in specs)
    assert all(s.prompt == f"What is {s.spec['a']} + {s.spec['b']}? Answer with the number." for s in specs)
    assert {env.sample(random.Random(i), "eval").spec["answer"] for i in range(5)}  # both splits draw
    spec = {"a": 8, "b": 6, "answer": "14"}
    for good in ("14", "The answer is 14.", "8 + 6 = 14", "8 + 6 = 14\n", "**14**", "It is 14!"):
        assert env.verify(good, spec).success == 1.0, good
    for bad, why in [
        ("The answer is 15.", "wrong answer 15 != 14"),
        ("14 is wrong, it is 12", "wrong answer 12"),
        ("fourteen", "no number"),
        ("x14", "no number"),
        ("14.5", "no number"),
        ("-14", "wrong answer -14"),
        ("", "no number"),
    ]:
        v = env.verify(bad, spec)
        assert v.success == 0.0 and why in v.reason, (bad, v)
    assert env.verify(None, spec).success == 0.0
    assert env.verify("1,234", {"a": 1000, "b": 234, "answer": "1234"}).success == 1.0
    for s in specs:
        assert env.verify(env.demonstration(s.spec), s.spec).success == 1.0
    with pytest.raises(SpecError):
        env.verify("14", {"answer": "fourteen"})


def test_arith_chat_2_is_two_digit_sums_with_disjoint_splits():
    env = get_env("arith-chat-2")
    train = [env.sample(random.Random(i)).spec for i in range(200)]
    held = [env.sample(random.Random(i), "eval").spec for i in range(50)]
    assert all(10 <= s["a"] <= 99 and 10 <= s["b"] <= 99 for s in train + held)
    assert not {(s["a"], s["b"]) for s in train} & {(s["a"], s["b"]) for s in held}
    assert env.verify("47 + 38 = 85", {"a": 47, "b": 38, "answer": "85"}).success == 1.0
    assert env.verify("47 + 38 = 75", {"a": 47, "b": 38, "answer": "85"}).success == 0.0
    mixed = [get_env("arith-chat-12").sample(random.Random(i)).spec for i in range(300)]
    assert all(0 <= s["a"] <= 99 and 0 <= s["b"] <= 99 for s in mixed)
    assert {len(str(s["a"])) for s in mixed} == {1, 2}


def test_llvmlite_guard_lets_vllm_scan_module_attributes():
    """vLLM's CPU worker reads vars(x).get("kernel") of every module attribute at start; llvmlite's
    ffi.lib (numba, via delta_codec) answers `__dict__` with a C-function wrapper unless guarded."""
    pytest.importorskip("llvmlite.binding")
    from llvmlite.binding import ffi

    from delta_codec.llvmlite_guard import guard_llvmlite_lib

    ffi.lib._fntab.pop("__dict__", None)  # as a fresh process has it
    assert hasattr(ffi.lib, "__dict__") and not isinstance(vars(ffi.lib), dict)
    assert guard_llvmlite_lib() is True
    assert vars(ffi.lib).get("kernel") is None
    assert guard_llvmlite_lib() is False  # once is enough
    assert callable(ffi.lib.LLVMPY_GetVersionInfo)  # llvmlite's own lookups are untouched


def test_held_out_prompts_go_through_the_chat_template_like_the_feeders(tmp_path):
    """trainer/evaluate.py tokenises held-out prompts as the workers do the feeder's: rendered
    through the chat template when the trainer's config says so."""
    from trainer.evaluate import prompt_ids

    chat_tokenizer_folder(tmp_path)
    tok = load_hf_tokenizer(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    q = "What is 2 + 3? Answer with the number."
    want = ref.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
    )
    want = want["input_ids"] if not isinstance(want, list) else want
    assert prompt_ids(tok, [q], chat_template=True) == [want]
    assert prompt_ids(tok, [q])[0][0] == tok.bos_id and prompt_ids(tok, [q]) != [want]
