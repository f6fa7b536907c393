"""Secure by default, the parts without a deployment: checkpoints never run code
and must be the run's own; a weight follower without a public key says so (log + gauge)."""

from __future__ import annotations

import shutil

import pytest
import torch
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

import delta_codec
from bus.weights.follower import WeightFollower
from bus.weights.publisher import WeightPublisher
from delta_codec import signing
from trainer import checkpoint
from trainer.digest_chain import read_chain


class _RunsCode:
    """Unpickling this calls Path.touch(marker): what a planted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (Path(self.marker),))


def _real_state(version: int, epoch: int, digest: str) -> checkpoint.TrainerState:
    """A state with what the trainer saves: fp32 weights, a stepped AdamW's state, ids, config."""
    torch.manual_seed(version)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return checkpoint.TrainerState(
        version=version,
        epoch=epoch,
        model=model.state_dict(),
        optimizer=opt.state_dict(),
        consumed=[f"r{version}"],
        digest=digest,
        model_config={"dim": 4},
        step=version,
        warmstarted=True,
    )


def test_planted_pickle_checkpoint_is_refused_and_its_code_never_runs(tmp_path):
    ckpt = tmp_path / "ckpt"
    good = _real_state(3, 2, "d3")
    checkpoint.save(ckpt, good)
    marker = tmp_path / "pwned"
    planted = checkpoint.path_for(ckpt, 9, 9)  # newest by name: tried first
    torch.save({"version": 9, "epoch": 9, "model": _RunsCode(marker)}, planted)

    try:
        checkpoint.load(planted)
        raise AssertionError("a checkpoint holding code was loaded")
    except checkpoint.CheckpointError as e:
        assert "unreadable" in str(e) and str(planted) in str(e)
    assert not marker.exists(), "loading the planted checkpoint ran its code"
    st = checkpoint.load_latest(ckpt)  # falls back to the genuine one
    assert not marker.exists()
    assert (st.version, st.epoch, st.digest, st.step, st.warmstarted) == (3, 2, "d3", 3, True)
    assert all(torch.equal(st.model[k], good.model[k]) for k in good.model)
    assert st.optimizer["param_groups"][0]["betas"] == (0.9, 0.95)
    assert all(
        torch.equal(st.optimizer["state"][0][k], good.optimizer["state"][0][k])
        for k in ("exp_avg", "exp_avg_sq")
    )
    # the shard-folder pruning pass reads every kept checkpoint too: it must not run it either
    checkpoint.save(ckpt, _real_state(4, 2, "d4"), keep=3)
    assert not marker.exists()


async def test_checkpoint_off_the_runs_digest_chain_is_refused(bus, tmp_path):
    """The run published v0 (keyframe) and v1 (delta); checkpoints are checked against those
    digests: a forged v1, or one ahead of anything published, is refused, the genuine one resumes."""
    await bus.provision()
    pub = WeightPublisher(bus, epoch=1, trainer_id="t")
    s0 = {"w": torch.arange(64, dtype=torch.float32).to(torch.bfloat16)}
    s1 = {"w": (s0["w"].float() + 1).to(torch.bfloat16)}
    await pub.publish_keyframe(s0, 0, {})
    await pub.publish_delta(delta_codec.encode_delta(s0, s1, from_version=0, to_version=1))
    d1 = delta_codec.state_digest(s1)
    chain = await read_chain(bus)
    assert chain.digests == {0: {delta_codec.state_digest(s0)}, 1: {d1}} and chain.latest == 1

    ckpt = tmp_path / "ckpt"
    checkpoint.save(ckpt, _real_state(1, 1, d1))
    checkpoint.save(ckpt, _real_state(1, 5, "f" * 64))  # well formed, newer epoch, wrong state
    assert checkpoint.load_latest(ckpt).epoch == 5  # without the check it would resume
    st = checkpoint.load_latest(ckpt, verify=chain.check)
    assert (st.version, st.epoch, st.digest) == (1, 1, d1)
    checkpoint.save(ckpt, _real_state(2, 6, "e" * 64))  # latest + 1: a crash before publishing
    assert checkpoint.load_latest(ckpt, verify=chain.check).version == 2
    checkpoint.save(ckpt, _real_state(7, 7, "e" * 64))  # never published anywhere near
    assert checkpoint.load_latest(ckpt, verify=chain.check).version == 2
    for p in checkpoint.list_checkpoints(ckpt):  # nothing of this run's: refused, loudly
        if p.name != checkpoint.path_for(ckpt, 5, 1).name:
            p.unlink()
    try:
        checkpoint.load_latest(ckpt, verify=chain.check)
        raise AssertionError("a checkpoint off the digest chain was resumed")
    except checkpoint.CheckpointError as e:
        assert "not this run's state" in str(e)


def test_follower_without_public_key_warns_and_exports_the_gauge():
    with capture_logs() as logs:
        WeightFollower(None, public_key=None, name="w-unsigned")
    warned = [r for r in logs if r["log_level"] == "warning" and "WITHOUT signature" in r["event"]]
    assert warned and warned[0]["follower"] == "w-unsigned"
    assert REGISTRY.get_sample_value("asyncrl_weights_unsigned") == 1.0
    _sk, pk = signing.generate_keypair()
    with capture_logs() as logs:
        WeightFollower(None, public_key=signing.public_key(pk), name="w-signed")
    assert not [r for r in logs if r["log_level"] == "warning"]
    assert REGISTRY.get_sample_value("asyncrl_weights_unsigned") == 0.0


async def test_trainer_resumes_only_a_checkpoint_of_its_own_digest_chain(bus, fresh_server, tmp_path):
    """The leader's resume path: a well-formed, self-consistent checkpoint of another model (newer
    epoch, so tried first) is refused against the run's published v0; the run's own is resumed."""
    import asyncio
    import dataclasses

    from tests.helpers.trainer import trainer_config
    from trainer.digest_chain import DigestChain
    from trainer.factory import build_learner, build_model, build_optimizer
    from trainer.leader import Trainer

    def trainer(cfg):
        model, mcfg = build_model(cfg)
        return Trainer(cfg, bus, build_learner(model, build_optimizer(model, cfg), cfg), mcfg)

    cfg = trainer_config(fresh_server.url, tmp_path)
    tr = trainer(cfg)
    epoch = await tr.lease.acquire(asyncio.Event())
    await asyncio.to_thread(tr.prepare)  # checkpoint of v0 under `epoch`
    await WeightPublisher(bus, epoch, cfg.trainer_id).publish_keyframe(tr.published, 0, tr.model_cfg)
    # another model: other initial weights
    other = trainer(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=cfg.run.seed + 1)))
    forged = other.state()
    forged.epoch, forged.digest = (
        epoch + 50,
        delta_codec.state_digest(other.learner.publication.published_state()),
    )
    assert forged.digest != tr.digest
    checkpoint.save(cfg.checkpoint.dir, forged)

    unchecked = trainer(cfg)  # without the chain: the forged one wins
    await asyncio.to_thread(unchecked.resume)
    assert delta_codec.state_digest(unchecked.learner.publication.published_state()) == forged.digest
    resumed = trainer(cfg)
    resumed.chain = await read_chain(bus)
    assert isinstance(resumed.chain, DigestChain) and resumed.chain.latest == 0
    await asyncio.to_thread(resumed.resume)
    assert delta_codec.state_digest(resumed.learner.publication.published_state()) == tr.digest


def test_sharded_checkpoint_metadata_is_read_without_running_code(tmp_path):
    """DCP unpickles a shard folder's .metadata; trainer/shards.py reads it with SafeReader: a real
    DCP checkpoint loads, a planted .metadata that would run code is refused and runs nothing."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainer.safe_dcp import SafeReader, UnsafeMetadata
    from trainer.shards import load_any

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "shards-a"), no_dist=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_any(fresh, fresh_opt, tmp_path, {"__dcp__": "shards-a"}, None)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))

    marker = tmp_path / "pwned"
    planted = tmp_path / "shards-b"
    shutil.copytree(tmp_path / "shards-a", planted)
    (planted / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(BaseException) as e:  # DCP wraps the reader's UnsafeMetadata (CheckpointException)
        load_any(fresh, fresh_opt, tmp_path, {"__dcp__": "shards-b"}, None)
    assert "checkpoint metadata refers to pathlib.Path.touch" in str(e.value), repr(e.value)
    with pytest.raises(UnsafeMetadata, match="builtins.getattr"):
        SafeReader(planted).read_metadata() if (planted / ".metadata").write_bytes(
            b"cbuiltins\ngetattr\n(cos\nsystem\nVtrue\ntR."
        ) else None
    assert not marker.exists(), "the planted metadata ran its code"


def test_versions_published_from_shards_count_in_the_digest_chain():
    """Manifests carry no state digest, but their versions were published: a sharded run's
    checkpoints at those versions resume (any digest), latest + 1 too, further ahead is refused.
    (The deposed-leader chaos scenario with publish = "sharded" hung when they were skipped: the
    standby refused every checkpoint past the keyframe.)"""
    from trainer.checkpoint import CheckpointError, TrainerState
    from trainer.digest_chain import DigestChain

    chain = DigestChain()
    chain.add(0, "a" * 64)  # the keyframe
    for v in (1, 2, 3):
        chain.add(v, "")  # manifests
    assert chain.latest == 3
    for v in (1, 3, 4):
        chain.check(TrainerState(version=v, epoch=1, model={}, optimizer={}, digest="b" * 64))
    try:
        chain.check(TrainerState(version=5, epoch=1, model={}, optimizer={}, digest="b" * 64))
        raise AssertionError("a checkpoint two versions past the last manifest was accepted")
    except CheckpointError as e:
        assert "latest v3" in str(e)
