"""swe-gen: tier-1 tasks as episode specs, oracle demonstrations in the worker's layout, the
loss-masked warm start and the episode-aware held-out eval."""

import dataclasses
import random

import pytest
import torch

from envs import get_env
from envs.base import SpecError
from envs.episode import EpisodeLimits, EpisodeTask
from envs.held_out import eval_specs, play_held_out
from envs.swe_env import SweGenEnv
from policy import CharTokenizer, ModelConfig, SamplingConfig, Transformer
from trainer.config import TrainerConfig
from trainer.warmstart import demo_batch, warm_start


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from envs import base

    e = SweGenEnv(task_dir=str(tmp_path_factory.mktemp("swe") / "set"), n_gen=10)
    e.tasks("train")
    old = base._INSTANCES.get("swe-gen")
    base._INSTANCES["swe-gen"] = e  # get_env (warm start) reads this small set, not tasks/swe-gen
    yield e
    base._INSTANCES.pop("swe-gen")
    if old is not None:
        base._INSTANCES["swe-gen"] = old


def test_registered(env):
    assert get_env("swe-gen") is env and "swe-gen" in __import__("envs").ENVS


def test_samples_are_episode_specs_of_their_split(env):
    rng = random.Random(0)
    for split in ("train", "eval"):
        ids = set()
        for _ in range(10):
            ts = env.sample(rng, split)
            t = EpisodeTask.from_dict(ts.spec["episode"])
            EpisodeLimits(**ts.spec["limits"])
            assert t.split == split and ts.prompt == t.instruction
            ids.add(t.task_id)
        assert ids <= {t.task_id for t in env.tasks(split)}
    assert not {t.task_id for t in env.tasks("train")} & {t.task_id for t in env.tasks("eval")}
    with pytest.raises(SpecError):
        env.verify("anything", ts.spec)


def test_held_out_eval_plays_every_eval_task_once_per_pass(env):
    pool = [t.task_id for t in env.tasks("eval")]
    n = 2 * len(pool) + 1
    ids = [EpisodeTask.from_dict(s.spec["episode"]).task_id for _, s in eval_specs(["swe-gen"], n, seed=3)]
    assert sorted(ids[: len(pool)]) == sorted(pool) and ids[len(pool) : 2 * len(pool)] == ids[: len(pool)]
    assert ids[-1] == ids[0]
    assert ids == [
        EpisodeTask.from_dict(s.spec["episode"]).task_id for _, s in eval_specs(["swe-gen"], n, seed=3)
    ]
    # an env without a finite split (arith) still draws at random, the envs in turn
    mixed = eval_specs(["swe-gen", "arith"], 4, seed=3)
    assert [type(e).__name__ for e, _ in mixed] == ["SweGenEnv", "ArithEnv"] * 2
    assert EpisodeTask.from_dict(mixed[2][1].spec["episode"]).task_id == ids[1]


def test_demonstration_is_the_worker_layout_with_model_turns_masked(env):
    tok = CharTokenizer.default()
    ts = env.sample(random.Random(1), "train")
    prompt, parts = env.demonstration_turns(ts.spec)
    assert prompt.endswith("ASSISTANT:\n") and parts[-1] == (parts[-1][0], True)
    assert [m for _, m in parts] == [True, False] * (len(parts) // 2) + [True]
    for text, model in parts:
        assert text.endswith("\n```") if model else text.startswith("\n\nOBSERVATION:\n")
    assert "submit" in parts[-1][0]
    # token-exact: the parts tokenised one by one are the whole conversation's tokenisation
    whole = tok.encode(prompt + "".join(t for t, _ in parts))
    assert tok.encode(prompt) + [i for t, _ in parts for i in tok.encode(t)] == whole
    prompts, comps, masks = demo_batch(["swe-gen"], 2, random.Random(1), tok)
    for (
        c,
        m,
    ) in zip(comps, masks):
        assert len(c) == len(m) and 0 < sum(m) < len(m)
    assert sum(masks[0]) == sum(len(tok.encode(t)) for t, model in parts if model)
    assert env.demonstration(ts.spec) == "".join(t for t, _ in parts)


def test_warm_start_loss_ignores_observation_tokens(env, monkeypatch):
    """The warm-start loss is the NLL of the model turns only (observations are context): equal to
    the masked mean computed by hand, and not to the mean over every completion token."""
    tok = CharTokenizer.default()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(tok.vocab_size, n_layers=1, max_seq_len=4096)).float()
    cfg = TrainerConfig(
        trainer_id="t", tasks={"envs": ["swe-gen"]}, warmstart={"lr": 1e-3, "steps": 2, "batch": 1}
    )
    import trainer.warmstart as ws

    losses = warm_start(model, cfg, tok=tok)
    assert len(losses) == 2 and all(x > 0 for x in losses)
    # the masked NLL is the mean over model tokens only: recompute it by hand for one demo
    from policy import sequence_logprobs

    prompts, comps, masks = ws.demo_batch(["swe-gen"], 1, random.Random(3), tok)
    res = sequence_logprobs(model, prompts, comps, SamplingConfig(temperature=1.0), replay_mask=False)
    m = torch.tensor(masks[0], dtype=torch.float32)
    want = float(-(res.logprobs[0] * m).sum() / m.sum())
    monkeypatch.setattr(ws, "demo_batch", lambda *a, **k: (prompts, comps, masks))
    model2 = Transformer(model.cfg).float()
    model2.load_state_dict(model.state_dict())
    got = warm_start(
        model2, dataclasses.replace(cfg, warmstart=dataclasses.replace(cfg.warmstart, steps=1)), tok=tok
    )[0]
    assert got == pytest.approx(want, rel=1e-4)
    everything = -(res.logprobs[0]).sum() / len(comps[0])
    assert float(everything) != pytest.approx(got, rel=1e-3)


def test_play_held_out_plays_held_out_episodes(env):
    tok = CharTokenizer.default()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(tok.vocab_size, n_layers=1, max_seq_len=2048)).float().eval()
    rng = random.Random(0)
    specs = [env.sample(rng, "eval").spec for _ in range(2)]
    for s in specs:
        s["limits"]["max_turns"], s["limits"]["max_turn_tokens"] = 2, 32
    with torch.no_grad():
        out = play_held_out(model, tok, specs, SamplingConfig(temperature=1.0), seed=0)
    assert out["eval_n"] == 2 and out["eval_success"] == 0.0  # an untrained model fixes nothing
    assert 1 <= out["eval_turns"] <= 2
    assert sum(v for k, v in out.items() if k.startswith("eval_term_")) == pytest.approx(1.0)


def test_play_held_out_has_no_episode_wall_clock(env):
    """Held-out episodes are played in lockstep, so an episode's wall clock would count the others'
    generation: the eval ends episodes by turns and tokens, never by `timeout`."""
    tok = CharTokenizer.default()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(tok.vocab_size, n_layers=1, max_seq_len=2048)).float().eval()
    specs = [env.sample(random.Random(1), "eval").spec]
    specs[0]["limits"].update(max_turns=2, max_turn_tokens=32, episode_wall_s=1e-6)
    with torch.no_grad():
        out = play_held_out(model, tok, specs, SamplingConfig(temperature=1.0), seed=0)
    assert out["eval_n"] == 1 and "eval_term_timeout" not in out, out


def test_toy_oracle_rewrites_the_named_function_with_its_original_text(env):
    """The toy limits' oracle: run_tests -> rewrite FILE (the bank's original function, the same
    text whichever of its lines the bug is on) -> run_tests -> submit, on the toy prompt, with
    run_tests observations cut to the failing tests' names."""
    import ast

    from envs.episode import TOY_SYSTEM_PROMPT
    from envs.oracle import function_fix
    from envs.repo_bank import MODULES

    bank = {
        (f"{m}.py", n.name): ast.get_source_segment(src, n) + "\n"
        for m, (src, _) in MODULES.items()
        for n in ast.parse(src).body
        if isinstance(n, ast.FunctionDef)
    }
    tasks = [t for t in env.tasks("train") if function_fix(t) is not None][:3]
    assert tasks
    for t in tasks:
        prompt, parts = env.demonstration_turns(env_spec(env, t))
        assert TOY_SYSTEM_PROMPT in prompt
        model = [x for x, m in parts if m]
        obs = [x for x, m in parts if not m]
        path, name = function_fix(t)[:2]
        assert (
            len(model) == 4 and "run_tests" in model[0] and "run_tests" in model[2] and "submit" in model[3]
        )
        assert model[1] == f"Fix {name}.\n```bash\nrewrite {path} <<'EOF'\n{bank[(path, name)]}EOF\n```"
        assert not any("view " in x for x in model)
        assert "FAILED tests/" in obs[0] and "Traceback" not in obs[0] and 'File "' not in obs[0]
        assert f"rewrote {name}" in obs[1]


def test_full_limits_keep_the_view_replace_oracle(env):
    from envs.oracle import run_oracle

    t = env.tasks("train")[0]
    msgs, turns, res = run_oracle(t, EpisodeLimits(max_turns=6))
    assert res.reward == 1.0 and "rewrite FILE" in msgs[0]["content"]
    assert [a["action"].split("```bash\n")[1].split()[0] for a in turns] == [
        "run_tests",
        "view",
        "replace",
        "run_tests",
        "submit",
    ]


def env_spec(env, task) -> dict:
    from envs.conversation import episode_spec

    return episode_spec(task, env.limits)


def test_swe_demo_env_builds_its_task_set_from_the_demo_bank(tmp_path, monkeypatch):
    """`swe-demo`: the same episodes as swe-gen over one-module repositories of DEMO_FUNCTIONS, in a
    task set of its own (built on first use, read as is afterwards)."""
    from envs import base
    from envs.oracle import function_fix
    from envs.swe_env import DEMO_FUNCTIONS

    monkeypatch.setenv("ASYNCRL_SWE_DEMO_TASKS", str(tmp_path / "demo"))
    e = base.ENVS["swe-demo"]()  # a fresh instance: get_env's shared one reads tasks/swe-demo
    assert e.name == "swe-demo" and e.task_dir == str(tmp_path / "demo")
    e.n_gen = 4  # a small set (the demo's is 160 repositories + eval top-up)
    train, ev = e.tasks("train"), e.tasks("eval")
    assert train and ev and (tmp_path / "demo" / "manifest.json").exists()
    for t in train + ev:
        assert (
            function_fix(t)[1] in DEMO_FUNCTIONS
            and len([p for p in t.files if not p.startswith("tests/")]) == 1
        )
    ts = e.sample(random.Random(0), "eval")
    assert ts.spec["limits"]["prompt_style"] == "toy"
