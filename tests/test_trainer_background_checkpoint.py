"""[trainer.checkpoint] background: the checkpoint is written by one thread while the next steps run.

A trainer process writing its checkpoints in the background (slowed down, so versions go out ahead
of their checkpoint) is SIGKILLed with a write in flight and versions published but not yet
durable; a second process resumes from the newest durable checkpoint and finishes the run. Every
version it (re)publishes, and its final weights, optimizer state and consumed ids, are bit-exact
those of an uninterrupted run on the same rollouts, and no rollout is lost or acked early. Plus:
the snapshot shares no memory with the live model and optimizer, and a bad value is refused."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncrl.nats_server import EmbeddedServer
from bench.chaoskit.streams import weights_history
from bus import BusConfig, connect
from bus import topology as topo
from bus.events import DeltaEvent
from bus.weights.rules import parse_version
from policy.config import ModelConfig
from policy.model import Transformer
from tests.helpers.trainer import MODEL, make_scored
from tests.helpers.trainer_process import ROOT, write_config
from trainer import checkpoint
from trainer.config import TrainerConfig

GROUPS = 10
ACK_WAIT_S = 4.0


def rollouts() -> list:
    """The same scored rollouts for both runs: GROUPS groups of 2, behaviour version 0."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_dict(MODEL))
    rng = random.Random(5)
    return [make_scored(model, f"g{g:02d}", i, 2, 0, rng) for g in range(GROUPS) for i in range(2)]


def start(tmp: Path, url: str, tid: str, max_steps: int, **faults) -> subprocess.Popen:
    cfg = tmp / f"{tid}.toml"
    write_config(cfg, url, tid, tmp, ack_wait_s=ACK_WAIT_S)
    text = cfg.read_text()
    text = text.replace("[trainer.checkpoint]\n", "[trainer.checkpoint]\nbackground = true\n", 1)
    text = text.replace("[trainer.run]\n", f"[trainer.run]\nmax_steps = {max_steps}\n", 1)
    if faults:
        text += "[trainer.faults]\n" + "".join(f"{k} = {v}\n" for k, v in faults.items())
    cfg.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(tmp / f"{tid}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "--config", str(cfg)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def log_tail(tmp: Path, tid: str) -> str:
    return (tmp / f"{tid}.log").read_text(errors="replace")[-3000:]


async def wait_exit(p: subprocess.Popen, tmp: Path, tid: str, timeout: float = 180) -> None:
    t0 = time.monotonic()
    while p.poll() is None:
        assert time.monotonic() - t0 < timeout, log_tail(tmp, tid)
        await asyncio.sleep(0.2)
    assert p.returncode == 0, log_tail(tmp, tid)


async def published_digests(bus) -> dict[int, list[tuple[int, str]]]:
    """version -> (epoch, digest) of every delta that produced it (a re-trained version: one per epoch)."""
    out: dict[int, list[tuple[int, str]]] = {}
    for e in await weights_history(bus):
        if isinstance(e, DeltaEvent):
            out.setdefault(e.to_version, []).append((e.epoch, e.new_digest))
    return out


async def ack_pending(bus) -> tuple[int, int]:
    info = await bus.js.consumer_info(topo.SCORED, topo.TRAINER_CONSUMER)
    return info.num_ack_pending, info.num_pending


async def one_run(tmp: Path, scored: list, kill: bool) -> dict:
    """A run on its own server; kill: SIGKILL the first trainer mid-run, a second one finishes."""
    tmp.mkdir()
    async with EmbeddedServer(store_dir=tmp / "nats") as srv:
        bus = await connect(BusConfig(servers=[srv.url], name="test"))
        try:
            await bus.provision()
            for sc in scored:  # all in the stream before a trainer starts: one fetch order
                await bus.publish(topo.scored_subject("arith"), sc)
            killed = {}
            if kill:
                # steps 0.4 s apart, each write held 1.5 s: versions go out ahead of the checkpoint
                a = start(tmp, srv.url, "A", GROUPS, step_delay_s=0.4, checkpoint_delay_s=1.5)
                try:
                    t0 = time.monotonic()
                    while True:
                        assert a.poll() is None, log_tail(tmp, "A")  # killed before it finished
                        assert time.monotonic() - t0 < 180, log_tail(tmp, "A")
                        raw = await bus.kv_get(topo.KEY_VERSION)
                        v = parse_version(raw) if raw else 0
                        st = checkpoint.load_latest(tmp / "ckpt")
                        if st is not None and 1 <= st.version and v >= st.version + 2:
                            break
                        await asyncio.sleep(0.05)
                    a.send_signal(signal.SIGKILL)
                    a.wait()
                finally:
                    if a.poll() is None:
                        a.kill()
                        a.wait()
                killed = {"published": v, "durable": checkpoint.load_latest(tmp / "ckpt").version}
                # the batches published but not durable were never acked: they come back
                assert (await ack_pending(bus))[0] >= 2 * (killed["published"] - killed["durable"])
                # redelivered (ack_wait ran out) before the next leader's first fetch: stream order
                await asyncio.sleep(ACK_WAIT_S + 1)
            b = start(tmp, srv.url, "B", GROUPS)
            try:
                await wait_exit(b, tmp, "B")
            finally:
                if b.poll() is None:
                    b.kill()
                    b.wait()
            return {
                "state": checkpoint.load_latest(tmp / "ckpt"),
                "digests": await published_digests(bus),
                "pending": await ack_pending(bus),
                **killed,
            }
        finally:
            await bus.close()


def assert_same(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), what  # the bits
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{what}[{i}]")
    else:
        assert a == b, what


async def test_background_checkpoint_killed_mid_write_resumes_bit_exact(tmp_path):
    scored = rollouts()
    ref = await one_run(tmp_path / "ref", scored, kill=False)
    got = await one_run(tmp_path / "killed", scored, kill=True)
    assert got["durable"] < got["published"], got  # killed with versions out ahead of the checkpoint
    r, g = ref["state"], got["state"]
    assert r.version == g.version == GROUPS and r.step == g.step == GROUPS
    assert g.epoch > r.epoch  # the second run's last checkpoint is the resumed leader's
    assert_same(r.model, g.model, "model")
    assert_same(r.optimizer, g.optimizer, "optimizer")
    assert r.digest == g.digest
    ids = sorted(sc.rollout["rollout_id"] for sc in scored)
    assert sorted(r.consumed) == sorted(g.consumed) == ids  # each once
    # every version published, by either leader (the rolled-back ones included), is the reference's
    assert set(ref["digests"]) == set(range(1, GROUPS + 1)) == set(got["digests"])
    assert all(len(ref["digests"][v]) == 1 for v in ref["digests"])
    for v, published in got["digests"].items():
        assert {d for _, d in published} == {d for _, d in ref["digests"][v]}, v
        # the versions published but not durable at the kill went out twice: once per leader
        twice = got["durable"] < v <= got["published"]
        assert len({ep for ep, _ in published}) == (2 if twice else 1), (v, published, got)
    assert ref["pending"] == got["pending"] == (0, 0)  # everything acked, once durable


def test_snapshot_shares_no_memory_with_the_live_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    st = checkpoint.TrainerState(
        version=1, epoch=1, model=model.state_dict(), optimizer=opt.state_dict(), consumed=["r1"]
    )
    snap = checkpoint.snapshot(st)
    before = {k: v.clone() for k, v in snap.model.items()}
    moments = [t.clone() for s in snap.optimizer["state"].values() for t in s.values()]
    live = [t for s in opt.state_dict()["state"].values() for t in s.values()] + list(
        model.state_dict().values()
    )
    taken = [t for s in snap.optimizer["state"].values() for t in s.values()] + list(snap.model.values())
    ptrs = {t.untyped_storage().data_ptr() for t in live}
    assert all(t.device.type == "cpu" and t.untyped_storage().data_ptr() not in ptrs for t in taken)
    model(torch.randn(2, 4)).sum().backward()  # the next step mutates everything in place
    opt.step()
    st.consumed.append("r2")
    assert_same(snap.model, before, "model")
    assert_same([t for s in snap.optimizer["state"].values() for t in s.values()], moments, "moments")
    assert not torch.equal(snap.model["weight"], model.weight.detach())  # the live state did move
    assert snap.consumed == ["r1"]
    # the next snapshot reuses the first one's buffers (its write is done): still none of the live ones
    st2 = checkpoint.TrainerState(version=2, epoch=1, model=model.state_dict(), optimizer=opt.state_dict())
    snap2 = checkpoint.snapshot(st2, reuse=snap)
    assert (
        snap2.model["weight"].untyped_storage().data_ptr()
        == snap.model["weight"].untyped_storage().data_ptr()
    )
    taken2 = [t for s in snap2.optimizer["state"].values() for t in s.values()] + list(snap2.model.values())
    assert all(t.untyped_storage().data_ptr() not in ptrs for t in taken2)
    assert_same(snap2.model, {k: v.detach() for k, v in model.state_dict().items()}, "model at 2")
    at2 = {k: v.clone() for k, v in snap2.model.items()}
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert_same(snap2.model, at2, "model at 2, after a third step")


def test_the_writer_runs_at_the_lowest_priority_and_counts_its_cpu(tmp_path):
    """Under `up` the write competes with the rollout workers (nice 10) for the cores: it must lose."""
    from trainer.checkpoint_writer import CheckpointWriter

    seen = {}
    writer = CheckpointWriter(
        tmp_path, keep=1, before_write=lambda: seen.update(nice=os.getpriority(os.PRIO_PROCESS, 0))
    )
    st = checkpoint.TrainerState(version=1, epoch=1, model={"w": torch.ones(1024, 256)}, optimizer={})
    path = writer.submit(st).result()
    writer.close()
    assert seen["nice"] == 19  # the writer thread's own nice (a thread id on Linux)
    assert os.getpriority(os.PRIO_PROCESS, 0) != 19  # the calling thread keeps its priority
    assert checkpoint.load(path).version == 1
    assert writer.writes == 1 and 0.0 <= writer.write_cpu_total_s <= writer.write_total_s + 0.05


@pytest.mark.parametrize("bad", ["always", 2, "inline"])  # ("yes", "on": true, as from env)
def test_a_bad_background_value_is_refused_clearly(bad):
    with pytest.raises(ValueError) as e:
        TrainerConfig(checkpoint={"background": bad})
    assert "trainer.checkpoint" in str(e.value) and "background" in str(e.value)
    assert "auto" in str(e.value)


def test_background_resolves_on_for_a_pretrained_start_and_as_set_otherwise():
    assert not TrainerConfig().checkpoint_in_background  # a fresh model: small state, inline
    assert TrainerConfig(policy={"init_checkpoint": "/some/hf/dir"}).checkpoint_in_background
    assert TrainerConfig(checkpoint={"background": True}).checkpoint_in_background
    off = TrainerConfig(policy={"init_checkpoint": "/some/hf/dir"}, checkpoint={"background": False})
    assert not off.checkpoint_in_background


def test_a_deposed_leaders_late_write_never_lands_nor_wins(tmp_path):
    """Fencing of the background writer: a write whose lease is gone by its rename leaves nothing
    (not even its tmp file); one that passed the check just before a takeover lands under the old
    epoch, and resume still takes the new leader's checkpoint."""
    from trainer.checkpoint_writer import CheckpointWriter

    def state(epoch: int, version: int) -> checkpoint.TrainerState:
        return checkpoint.TrainerState(
            version=version, epoch=epoch, model={"w": torch.full((3,), float(version))}, optimizer={}
        )

    checkpoint.save(tmp_path, state(2, 5))  # the new leader (epoch 2) resumed at v5 and saved
    writer = CheckpointWriter(tmp_path, keep=3)
    late = writer.submit(state(1, 7), commit_if=lambda: False)  # epoch 1's lease has expired
    with pytest.raises(checkpoint.CheckpointError, match="no longer leading"):
        late.result(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-e00000002-v00000005.pt"]
    writer.submit(state(1, 8), commit_if=lambda: True).result(timeout=60)  # checked just before
    writer.close()
    st = checkpoint.load_latest(tmp_path)
    assert (st.epoch, st.version) == (2, 5) and torch.equal(st.model["w"], torch.full((3,), 5.0))
