"""The weight path's one publisher interface: a gathered and a sharded version go out
through `WeightPublisher.publish` alike, and the leader's step and publication take either encoder
(trainer/encoders.py) the same way: same events order, same metrics, same digest handling."""

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

import delta_codec
from bus import topology as topo
from bus.events import decode
from bus.weights.follower import WeightFollower
from bus.weights.manifest import ShardedVersion
from bus.weights.publisher import GatheredVersion, WeightPublisher
from delta_codec.sharded import digest_matches, encode_part, shard_rows
from policy.model import inference_state
from tests.helpers.trainer import publish_groups, trainer_config
from tests.helpers.weights import CFG, trajectory
from trainer import checkpoint
from trainer.batcher import Batcher
from trainer.encoders import GatheredEncoder, ShardedEncoder, make_encoder
from trainer.factory import build_learner, build_model, build_optimizer
from trainer.leader import Trainer


class FakeJS:
    def __init__(self, bus):
        self.bus = bus

    async def stream_info(self, name):
        return SimpleNamespace(state=SimpleNamespace(last_seq=len(self.bus.events)))


class FakeBus:
    """What WeightPublisher writes through: WEIGHTS events, blobs, the KV version."""

    def __init__(self):
        self.events, self.blobs, self.versions = [], {}, []
        self.js = FakeJS(self)

    async def publish(self, subject, ev, headers=None):
        assert int(headers["Nats-Expected-Last-Sequence"]) == len(self.events)  # the fenced write
        self.events.append((subject, ev))
        return SimpleNamespace(seq=len(self.events))

    async def put_blob(self, name, data):
        self.blobs[name] = bytes(data)
        return ""

    async def kv_put(self, key, value):
        assert key == topo.KEY_VERSION
        self.versions.append(int(value))
        return len(self.versions)


def sharded(base: dict, new: dict, world: int, from_version: int, to_version: int) -> list[bytes]:
    """The parts `world` ranks would encode (each its rows of every tensor)."""
    parts = []
    for rank in range(world):
        ranges = {n: shard_rows(t.shape[0], rank, world) for n, t in new.items()}
        parts.append(
            encode_part(
                {n: base[n][slice(*ranges[n])] for n in base},
                {n: new[n][slice(*ranges[n])] for n in new},
                ranges,
                from_version=from_version,
                to_version=to_version,
            ).to_bytes()
        )
    return parts


@pytest.mark.parametrize("keyframe", [False, True])
async def test_one_interface_publishes_a_gathered_and_a_sharded_version(keyframe):
    s1, s2 = trajectory(3)[1:]
    versions = {
        "gathered": GatheredVersion(
            delta_codec.encode_delta(s1, s2, from_version=1, to_version=2), keyframe=s2 if keyframe else None
        ),
        "sharded": ShardedVersion.of(sharded(s1, s2, 2, 1, 2), 1, 2, keyframe=s2 if keyframe else None),
    }
    seen = {}
    for kind, version in versions.items():
        bus = FakeBus()
        nbytes = await WeightPublisher(bus, 3, "T").publish(version, CFG)
        kinds = [ev.KIND for _, ev in bus.events]
        update = bus.events[0][1]
        assert kinds == [{"gathered": "Delta", "sharded": "Manifest"}[kind]] + (
            ["Keyframe"] if keyframe else []
        )
        assert bus.versions == [2]  # the KV version bumped once, by the update
        assert nbytes == (update.size if kind == "gathered" else update.part_bytes) > 0
        if kind == "sharded":
            parts = [b for name, b in bus.blobs.items() if name.startswith("part-")]
            assert nbytes == sum(map(len, parts)) and len(parts) == 2
        assert (update.from_version, update.to_version, update.epoch) == (1, 2, 3)
        assert digest_matches(s2, version.new_digest)  # the digest the leader records, either kind
        seen[kind] = (version.from_version, version.to_version, version.changed_frac)
    assert seen["gathered"] == seen["sharded"] and 0 < seen["gathered"][2] < 1


async def publish_two_versions(bus, fresh_server, tmp_path, layout: str):
    """The leader's own path (prepare, then train_on twice), keyframe_interval 2."""
    cfg = trainer_config(
        fresh_server.url,
        tmp_path,
        batch={"groups": 1, "group_size": 4, "max_lag": 1000},
        publish={"layout": layout, "keyframe_interval": 2},
    )
    model, mcfg = build_model(cfg)
    tr = Trainer(cfg, bus, build_learner(model, build_optimizer(model, cfg), cfg), mcfg)
    assert isinstance(tr.encoder, {"gathered": GatheredEncoder, "sharded": ShardedEncoder}[layout])
    epoch = await tr.lease.acquire(asyncio.Event())
    await asyncio.to_thread(tr.prepare)
    publisher = tr.make_publisher(epoch)
    await publisher.publish_keyframe(tr.published, 0, mcfg)
    await publish_groups(bus, model, 2, 4)
    batcher = Batcher(bus, cfg, tr.consumed, mcfg.vocab_size)
    await batcher.start()
    lost, publishing = asyncio.Event(), None
    try:
        for _ in range(2):
            publishing = await tr.train_on(
                await batcher.next_batch(tr.version), batcher, publisher, lost, publishing
            )
        await publishing
    finally:
        await batcher.close()
        await tr.lease.release()
    return tr, model


@pytest.mark.parametrize("layout", ["gathered", "sharded"])
async def test_leader_publishes_either_encoding_through_the_one_interface(
    bus, fresh_server, tmp_path, layout
):
    tr, model = await publish_two_versions(bus, fresh_server, tmp_path, layout)
    mine = inference_state(model)
    assert tr.version == 2 and int((await bus.kv_get(topo.KEY_VERSION)).decode()) == 2
    info = await bus.js.stream_info(topo.WEIGHTS)
    evs = [
        decode((await bus.js.get_msg(topo.WEIGHTS, seq=s)).data) for s in range(1, info.state.last_seq + 1)
    ]
    update = {"gathered": "Delta", "sharded": "Manifest"}[layout]
    assert [(e.KIND, e.version) for e in evs] == [("Keyframe", 0), (update, 1), (update, 2), ("Keyframe", 2)]
    # the digest the encoded version carried: the leader's, the checkpoint's, and the state's
    st = checkpoint.load_latest(tr.cfg.checkpoint.dir)
    assert st.version == 2 and st.digest == tr.digest and digest_matches(mine, tr.digest)
    assert tr.digest.startswith("shards1:") == (layout == "sharded")
    # the same metrics, whichever the encoding
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics" / "trainer.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "delta_bytes" in r]
    assert [r["version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["encode_s"] > 0 and r["publish_s"] > 0 and "encode_frac" in r
        assert r["delta_bytes"] > 0 and 0 < r["changed_frac"] < 1 and r["checkpointed"]
    # a worker following WEIGHTS holds the trainer's bf16 bits
    feed = WeightFollower(bus)
    target = await feed.latest_state()
    await feed.close()
    assert target.version == 2 and not feed.refused
    assert all(torch.equal(target.state[k].view(torch.int16), mine[k].view(torch.int16)) for k in mine)


def test_the_encoder_is_chosen_once_from_the_layout(tmp_path):
    for layout, kind in (("gathered", GatheredEncoder), ("sharded", ShardedEncoder)):
        cfg = trainer_config("nats://127.0.0.1:1", tmp_path, publish={"layout": layout})
        assert type(make_encoder(cfg, learner=None)) is kind
