"""`torchrun --nproc_per_node 2 -m trainer` with `publish = "sharded"` (FSDP2 on gloo, a real
nats-server): every version goes out as two rank-encoded parts plus one signed manifest, and a real
WeightFollower walking WEIGHTS reaches, version by version, exactly the bf16 state the gathered
path publishes (the trainer's own gathered keyframe, and each sharded checkpoint loaded whole)."""

from pathlib import Path

import pytest
import torch

from asyncrl.launch import write_toml
from bus import topology as topo
from bus.events import decode
from bus.weights.follower import StateTarget, WeightFollower
from delta_codec import signing
from delta_codec.sharded import digest_matches
from policy import inference_state
from tests.helpers.fsdp import launch
from trainer import checkpoint
from trainer.config import TrainerConfig
from trainer.factory import build_learner, build_model, build_optimizer
from trainer.leader import Trainer

from .test_trainer_bus import publish_groups, trainer_config

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def test_publish_mode_is_validated():
    assert TrainerConfig(publish={"layout": "sharded"}).publish.layout == "sharded"
    with pytest.raises(ValueError, match="layout"):
        TrainerConfig(publish={"layout": "scattered"})


def gathered_state(cfg, st: checkpoint.TrainerState) -> dict:
    """The bf16 state of a checkpoint as one process holds it: what the gathered path publishes."""
    model, _ = build_model(cfg)
    build_learner(model, build_optimizer(model, cfg), cfg).checkpoint.load(
        cfg.checkpoint.dir, st.model, st.optimizer
    )
    return inference_state(model)


async def test_two_rank_sharded_publication_is_bit_exact_for_a_real_follower(bus, fresh_server, tmp_path):
    sk, pk = signing.generate_keypair()
    (tmp_path / "sk.hex").write_text(sk.hex())
    cfg = trainer_config(
        fresh_server.url,
        tmp_path,
        run={"max_steps": STEPS},
        batch={"groups": 2, "group_size": 3},
        checkpoint={"keep": STEPS + 1},
    )
    model, mcfg = build_model(cfg)
    await publish_groups(bus, model, 2 * STEPS, 3, seed=5)
    conf = tmp_path / "t.toml"
    write_toml(
        conf,
        {
            "trainer": {
                "trainer_id": "shards",
                "policy": {"model": {k: v for k, v in cfg.policy.model.items() if v is not None}},
                "batch": {"groups": 2, "group_size": 3, "fetch_timeout_s": 0.2},
                "tasks": {"feed": False},
                "optim": {"lr": cfg.optim.lr},
                "run": {"max_steps": STEPS},
                "checkpoint": {"dir": str(cfg.checkpoint.dir), "keep": STEPS + 1},
                "publish": {
                    "layout": "sharded",
                    "keyframe_interval": 2,
                    "signing_key": str(tmp_path / "sk.hex"),
                },
                "bus": {"servers": [fresh_server.url]},
            }
        },
    )
    out = launch(["-m", "trainer", "--config", str(conf)], timeout_s=300)
    assert out.returncode == 0, out.stderr.decode()[-3000:]

    # WEIGHTS: keyframe v0, then per version one manifest of 2 parts (and the gathered keyframe v2)
    info = await bus.js.stream_info(topo.WEIGHTS)
    raws = [await bus.js.get_msg(topo.WEIGHTS, seq=s) for s in range(1, info.state.last_seq + 1)]
    evs = [decode(r.data) for r in raws]
    assert [(e.KIND, e.version) for e in evs] == [
        ("Keyframe", 0),
        ("Manifest", 1),
        ("Manifest", 2),
        ("Keyframe", 2),
        ("Manifest", 3),
    ]
    assert all(e.parts == 2 and e.part_bytes > 0 for e in evs if e.KIND == "Manifest")

    # the gathered bf16 state of every version, from the checkpoints the two ranks wrote
    states = {}
    for p in checkpoint.list_checkpoints(cfg.checkpoint.dir):
        st = checkpoint.load(p)
        states[st.version] = gathered_state(cfg, st)
        assert digest_matches(states[st.version], st.digest), st.version  # the recorded digest holds
        if st.version > 0:
            assert st.digest.startswith("shards2:")  # recorded from the parts, nothing gathered
    assert sorted(states) == list(range(STEPS + 1))

    feed, target = WeightFollower(bus, public_key=pk, name="w"), StateTarget()
    for raw, ev in zip(raws, evs):  # the follower's own path, message by message
        await feed._apply_or_refuse(target, raw)
        assert target.version == ev.version and all(
            torch.equal(target.state[k], v) for k, v in states[ev.version].items()
        ), ev.msg_id()
        if ev.KIND == "Keyframe" and ev.version == 2:  # the trainer's gathered state at v2
            kf = await feed._load_keyframe(ev, raw.seq)
            assert all(torch.equal(target.state[k], v) for k, v in kf.state.items())
    assert feed.applied["manifest"] == STEPS and not feed.refused
    late = await WeightFollower(bus, public_key=pk).latest_state()  # keyframe v2 + manifest v3
    assert late.version == STEPS and all(torch.equal(late.state[k], v) for k, v in states[STEPS].items())

    # a standby of another world size resumes from the sharded-digest checkpoint
    one = TrainerConfig(**{**cfg.__dict__, "trainer_id": "one"})
    learner = build_learner(model, build_optimizer(model, one), one)
    trainer = Trainer(one, bus, learner, mcfg)
    assert trainer.resume() and trainer.version == STEPS
