"""Inference regions over an emulated WAN: the delay line, regional mirrors feeding workers,
the mirror-lag traps, and a region's death (its tasks come back to the others, none lost).

Two regions on loopback (bench.wanlab), each behind a bench.delayline link; ≤ 60 s in all."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

import delta_codec
from bench.delayline import DelayLine, LinkSpec
from bench.wanlab import Lab
from bus import events
from bus import topology as topo
from bus.events import Task
from bus.weights.follower import StateTarget, WeightFollower

# -- the delay line ---------------------------------------------------------------------------
from bus.weights.publisher import WeightPublisher
from bus.weights.regions import MirrorMissing, WeightSource


# -- the delay line ---------------------------------------------------------------------------
async def _echo_server():
    async def echo(r, w):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


@pytest.mark.asyncio
async def test_delayline_delays_paces_counts_and_cuts():
    srv, port = await _echo_server()
    line = DelayLine("127.0.0.1", port, LinkSpec(delay_ms=40, rate_mbit=8))  # 1 MB/s each way
    lport = await line.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", lport)
        t0 = time.monotonic()
        w.write(b"x")
        await r.readexactly(1)
        rtt = time.monotonic() - t0
        assert 0.075 <= rtt < 0.5, rtt  # two one-way delays

        payload = bytes(300_000)
        t0 = time.monotonic()
        w.write(payload)
        await r.readexactly(len(payload))
        took = time.monotonic() - t0
        assert took >= 0.3 + 0.08 - 0.02, took  # 300 kB at 1 MB/s, plus the round trip
        c = line.counters()
        assert c["up"]["bytes"] == c["down"]["bytes"] == len(payload) + 1

        await line.cut()  # link down: reset, then refused
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(r.readexactly(1), 2)
        r2, w2 = await asyncio.open_connection("127.0.0.1", lport)
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            w2.write(b"y")
            await asyncio.wait_for(r2.readexactly(1), 2)
        assert line.refused >= 1
        line.restore()
        r3, w3 = await asyncio.open_connection("127.0.0.1", lport)
        w3.write(b"z")
        assert await asyncio.wait_for(r3.readexactly(1), 2) == b"z"
        w3.close()
    finally:
        await line.close()
        srv.close()


@pytest.mark.asyncio
async def test_delayline_loss_stalls_the_stream_without_losing_bytes():
    srv, port = await _echo_server()
    line = DelayLine("127.0.0.1", port, LinkSpec(delay_ms=10, loss=0.02), seed=1)
    lport = await line.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", lport)
        payload = bytes(range(256)) * 2000  # 512 kB: ~350 segments each way
        w.write(payload)
        assert await asyncio.wait_for(r.readexactly(len(payload)), 20) == payload
        c = line.counters()
        assert c["up"]["stalls"] + c["down"]["stalls"] > 0
        w.close()
    finally:
        await line.close()
        srv.close()


def test_linkspec_rejects_bad_values():
    for bad in (dict(delay_ms=-1), dict(rate_mbit=-2), dict(loss=1.0), dict(mss=0)):
        with pytest.raises(ValueError):
            LinkSpec(**bad)
    with pytest.raises(ValueError, match="storage"):
        topo.MirrorConfig(storage="tape")


def test_a_region_worker_config_is_checked_before_start():
    """weights_domain is a subject token, and a region's worker must address the hub for work:
    without js_domain its task pulls (and provisioning) would go to the region's own JetStream."""
    from kernel import ConfigError, load_config
    from rollout_worker.config import WorkerConfig

    env = {"ASYNCRL_BUS__JS_DOMAIN": "hub", "ASYNCRL_BUS__WEIGHTS_DOMAIN": "eu"}
    assert load_config(WorkerConfig, environ=env).bus.weights_domain == "eu"
    for bad, msg in (
        ({"ASYNCRL_BUS__WEIGHTS_DOMAIN": "eu"}, "needs js_domain"),
        (
            {**env, "ASYNCRL_BUS__WEIGHTS_DOMAIN": "eu.west"},
            r"\[bus\] weights_domain: .*pattern.*\(got 'eu.west'\)",
        ),
        ({**env, "ASYNCRL_BUS__WEIGHTS_DOMAIN": "eu>"}, r"\[bus\] weights_domain: .*pattern.*\(got 'eu>'\)"),
        ({**env, "ASYNCRL_BUS__JS_DOMAIN": "h b"}, r"\[bus\] js_domain: .*pattern.*\(got 'h b'\)"),
    ):
        with pytest.raises(ConfigError, match=msg):
            load_config(WorkerConfig, environ=bad)


# -- regions ---------------------------------------------------------------------------------
def _state(n: int = 300_000, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": (torch.randn(n // 2, generator=g) * 0.02).to(torch.bfloat16),
        "b": (1 + torch.randn(n - n // 2, generator=g) * 0.02).to(torch.bfloat16),
    }


def _step(state, frac: float, seed: int):
    """~frac of the elements moved by a tiny amount (as an optimizer step does to bf16 weights)."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, t in state.items():
        f = t.float()
        mask = torch.rand(f.shape, generator=g) < frac
        f = torch.where(mask, f * (1 + 0.02 * torch.sign(torch.randn(f.shape, generator=g))), f)
        new[k] = f.to(torch.bfloat16)
    return new


@pytest.fixture
async def lab(tmp_path):
    lab = Lab(
        tmp_path,
        {"near": LinkSpec(delay_ms=10, rate_mbit=200), "far": LinkSpec(delay_ms=40, rate_mbit=100)},
        topology=topo.TopologyConfig(storage="memory", ack_wait_s=2.0, max_deliver=20, weights_keep=8),
    )
    await lab.start()
    yield lab
    await lab.close()


async def _follow(src, name, **kw):
    target, stop = StateTarget(), asyncio.Event()
    feed = WeightFollower(src, name=name, **kw)
    task = asyncio.ensure_future(feed.follow(target, stop))
    return target, stop, task, feed


async def _until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout}s")
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_mirrors_carry_each_update_once_per_region_and_feed_every_worker(lab):
    hub = await lab.hub_bus("trainer")
    pub = WeightPublisher(hub, epoch=1, trainer_id="t", inline_max=64 * 1024)  # keyframe via a blob
    state = _state()
    await pub.publish_keyframe(state, 0, {})
    followers = []  # near: 3 workers on its mirrors; far: 3 reading the hub
    for region, read in (("near", "mirror"), ("far", "hub")):
        for i in range(3):
            _, src = await lab.worker_bus(region, f"{region}-{read}-{i}", read=read)
            followers.append((region, read, *await _follow(src, f"{region}-{read}-{i}")))
    await _until(lambda: all(f[2].version == 0 for f in followers), 20, "keyframe everywhere")

    for v in range(1, 4):
        new = _step(state, 0.01, v)
        d = delta_codec.encode_delta(state, new, from_version=v - 1, to_version=v)
        size = len(d.to_bytes())
        before = await lab.counters()
        await pub.publish_delta(d)
        # B023: the lambda is called in this iteration only
        await _until(lambda: all(f[2].version == v for f in followers), 15, f"v{v} everywhere")  # noqa: B023
        await asyncio.sleep(0.3)  # let the link settle before reading its counters
        after = await lab.counters()
        state = new
        wan = {r: after[r]["down"]["bytes"] - before[r]["down"]["bytes"] for r in ("near", "far")}
        # mirror: the delta crosses once (plus protocol); hub: once per worker, plus the inline
        # copy on the plain wake-up subject
        assert size < wan["near"] < 1.5 * size, (v, wan, size)
        assert wan["far"] > 3 * size, (v, wan, size)
    for region, read, target, stop, _task, feed in followers:
        assert all(torch.equal(target.state[k], state[k]) for k in state), (region, read)
        assert not feed.refused, (region, read, feed.stats())
        stop.set()
    await asyncio.gather(*(f[4] for f in followers))

    # the blob was read from the region's mirror by our reader (bound by stream name); nats.py's
    # ObjectStore.get looks the stream up by subject, which a mirror does not have
    _, src = await lab.worker_bus("far", "probe", read="mirror")
    assert isinstance(src, WeightSource)
    obs = await src.js.object_store(topo.BLOB_BUCKET)
    with pytest.raises(Exception):  # noqa: B017  (nats.py's own failure, whatever its type)
        await obs.get("keyframe-e1-v0")
    assert len(await src.get_blob("keyframe-e1-v0")) > 64 * 1024


@pytest.mark.asyncio
async def test_feed_reads_by_sequence_when_woken_before_the_mirror_holds_the_message(lab):
    """The wake-up (plain subject from the hub) arrives while the region's mirror does not hold
    the message: the feed must read again soon, not wait poll_s for another wake-up."""
    hub = await lab.hub_bus("trainer")
    pub = WeightPublisher(hub, epoch=1, trainer_id="t")
    state = _state(20_000)
    await pub.publish_keyframe(state, 0, {})
    _, src = await lab.worker_bus("near", "w", read="mirror")
    src.wake_on = "hub"
    target, stop, task, feed = await _follow(src, "w", poll_s=0.2)
    await _until(lambda: target.version == 0, 20, "keyframe")
    feed.poll_s = 30.0  # from now on only a wake-up (or the re-read) moves it
    await asyncio.sleep(0.3)  # the feed is now waiting (up to poll_s) for a wake-up

    region_js = src.js
    await region_js.delete_stream(topo.WEIGHTS)  # the mirror misses what comes next
    new = _step(state, 0.01, 1)
    await pub.publish_delta(delta_codec.encode_delta(state, new, from_version=0, to_version=1))
    await asyncio.sleep(0.5)  # woken; read; nothing there
    assert target.version == 0
    t0 = time.monotonic()
    await lab.provision_region("near")  # the mirror comes back and copies the hub's stream
    await _until(lambda: target.version == 1, 10, "v1 after the mirror caught up")
    assert time.monotonic() - t0 < 10
    stop.set()
    await task


@pytest.mark.asyncio
async def test_blob_reader_waits_for_a_blob_the_mirror_has_not_got_yet(lab):
    hub = await lab.hub_bus("trainer")
    _, src = await lab.worker_bus("far", "w", read="mirror")
    src.blob_wait_s = 15.0
    await src.blob_store()  # bound to the mirror while it exists
    await src.js.delete_stream(topo.BLOB_STREAM)  # the region's mirror misses the put
    data = os.urandom(700_000)  # incompressible: the leaf link compresses (s2)
    await hub.put_blob("late", data)
    _, fresh = await lab.worker_bus("far", "w2", read="mirror")
    with pytest.raises(MirrorMissing, match="provision"):  # a region without mirrors: said so
        await fresh.get_blob("late")
    got = asyncio.ensure_future(src.get_blob("late"))
    await asyncio.sleep(1.0)
    assert not got.done()  # waiting, not failing (the mirror is not even there)
    await lab.provision_region("far")  # the mirror comes back and copies the blob
    assert await asyncio.wait_for(got, 20) == data
    assert (await lab.counters())["far"]["down"]["bytes"] > len(data)
    src.blob_wait_s = 0.2
    from bus import BlobError

    with pytest.raises(BlobError, match="not found"):
        await src.get_blob("never-put")


@pytest.mark.asyncio
async def test_region_death_reroutes_its_tasks_and_its_feed_resumes_past_retention(lab):
    """`far` dies holding tasks: after ack_wait `near` does them, none lost. Weights move on past
    the hub's delta retention meanwhile; when `far` is back its mirror holds only what the hub
    kept, and far's feed (the same WeightFollower, reconnected) resyncs from a keyframe."""
    hub = await lab.hub_bus("trainer")
    pub = WeightPublisher(hub, epoch=1, trainer_id="t")
    state = _state(20_000)
    await pub.publish_keyframe(state, 0, {})
    _, src = await lab.worker_bus("far", "far-feed", read="mirror")
    target, stop, task, feed = await _follow(src, "far-feed", poll_s=0.2)
    await _until(lambda: target.version == 0, 20, "far at v0")

    n_tasks = 24
    await hub.publish_many(
        [(topo.task_subject("wan"), Task(task_id=f"t{i}", env="wan", prompt="p")) for i in range(n_tasks)]
    )
    done: dict[str, list[str]] = {"near": [], "far": []}
    stop_work = asyncio.Event()

    async def worker(region: str, bus, hold_s: float):
        sub = await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
        while not stop_work.is_set():
            for m in await sub.fetch(1, timeout=0.5):
                await asyncio.sleep(hold_s)
                try:
                    await m.ack_sync(timeout=2)
                    done[region].append(events.decode(m.data, Task).task_id)
                except Exception:
                    pass  # the region died with the task: it comes back after ack_wait

    far_bus, _ = await lab.worker_bus("far", "far-w")
    near_bus, _ = await lab.worker_bus("near", "near-w")
    workers = [
        asyncio.ensure_future(worker("far", far_bus, 0.1)),
        asyncio.ensure_future(worker("far", far_bus, 0.1)),
        asyncio.ensure_future(worker("near", near_bus, 0.3)),
    ]
    await _until(lambda: len(done["far"]) >= 2, 20, "far working")
    await lab.kill_region("far")
    died_with = n_tasks - len(set(done["near"]) | set(done["far"]))

    keep = lab.topology.weights_keep
    for v in range(1, keep + 6):
        new = _step(state, 0.01, v)
        await pub.publish_delta(delta_codec.encode_delta(state, new, from_version=v - 1, to_version=v))
        state = new
        if v == keep + 2:
            await pub.publish_keyframe(state, v, {})

    await _until(lambda: len(set(done["near"]) | set(done["far"])) >= n_tasks, 30, "every task done")
    stop_work.set()
    await asyncio.gather(*workers, return_exceptions=True)
    info = await hub.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert len(set(done["near"]) | set(done["far"])) == n_tasks and died_with > 0

    assert target.version == 0
    await lab.start_region("far")  # a fresh server: its memory mirrors are declared again
    await _until(lambda: target.version == keep + 5, 30, "far caught up")
    assert all(torch.equal(target.state[k], state[k]) for k in state)
    assert feed.resyncs >= 1 and feed.applied["keyframe"] >= 1, feed.stats()
    stop.set()
    await task


@pytest.mark.chaos
@pytest.mark.timeout(600)
@pytest.mark.asyncio
async def test_link_cut_then_back_mirror_catches_up_and_feed_resumes(lab):
    """A region's link is cut while versions move past retention; when it is back the mirror
    catches up on the server's own retry schedule (tens of seconds: see docs/operations.md)."""
    hub = await lab.hub_bus("trainer")
    pub = WeightPublisher(hub, epoch=1, trainer_id="t")
    state = _state(20_000)
    await pub.publish_keyframe(state, 0, {})
    _, src = await lab.worker_bus("near", "near-feed", read="mirror")
    target, stop, task, feed = await _follow(src, "near-feed", poll_s=0.2)
    await _until(lambda: target.version == 0, 20, "near at v0")
    await lab.cut("near")
    keep = lab.topology.weights_keep
    for v in range(1, keep + 6):
        new = _step(state, 0.01, v)
        await pub.publish_delta(delta_codec.encode_delta(state, new, from_version=v - 1, to_version=v))
        state = new
        if v == keep + 2:
            await pub.publish_keyframe(state, v, {})
    await asyncio.sleep(2)
    assert target.version == 0
    await lab.restore("near")
    await _until(lambda: target.version == keep + 5, 120, "near caught up")
    assert all(torch.equal(target.state[k], state[k]) for k in state)
    assert feed.resyncs >= 1, feed.stats()
    stop.set()
    await task


# -- a real rollout worker process in a region ------------------------------------------------
async def test_rollout_worker_process_in_a_region_patches_from_its_mirror(tmp_path):
    """`python -m rollout_worker` configured only by env for region `eu` (servers: eu's server,
    js_domain: hub, weights_domain: eu): both workers load the keyframe and patch every delta,
    and each delta crosses the link once, not once per worker (the old worker read the hub)."""
    import subprocess
    import sys

    import policy
    from bus.events import Heartbeat
    from bus.events import decode as decode_event

    topology = topo.TopologyConfig(storage="memory")
    lab = Lab(tmp_path, {"eu": LinkSpec(delay_ms=10, rate_mbit=200)}, topology=topology)
    await lab.start()
    procs: list[subprocess.Popen] = []
    try:
        hub = await lab.hub_bus("trainer")
        cfg = policy.ModelConfig.tiny(vocab_size=policy.CharTokenizer.default().vocab_size, max_seq_len=64)
        torch.manual_seed(3)
        state = policy.inference_state(policy.Transformer(cfg))
        pub = WeightPublisher(hub, epoch=1, trainer_id="t", inline_max=256 * 1024)
        await pub.publish_keyframe(state, 0, cfg)  # > inline_max: a blob, read from eu's mirror

        patched: dict[str, int] = {}

        async def on_beat(msg):
            hb = decode_event(msg.data, Heartbeat)  # every beat carries the engine's version
            patched[hb.component_id] = max(patched.get(hb.component_id, -1), hb.version)

        await hub.nc.subscribe("rl.heartbeat.rollout_worker.>", cb=on_beat)

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for i in range(2):
            env = {
                **os.environ,
                "PYTHONPATH": root,
                "OMP_NUM_THREADS": "1",
                "ASYNCRL_BUS__SERVERS": lab.regions["eu"].url,
                "ASYNCRL_BUS__JS_DOMAIN": topo.HUB_DOMAIN,
                "ASYNCRL_BUS__WEIGHTS_DOMAIN": "eu",
                "ASYNCRL_BUS__TOPOLOGY__STORAGE": "memory",
                "ASYNCRL_WORKER_ID": f"eu-{i}",
                "ASYNCRL_ENGINE__SLOTS": "1",
                "ASYNCRL_ENGINE__MAX_LEN": "64",
                "ASYNCRL_RUN__HEARTBEAT_S": "0.5",
            }
            log = open(tmp_path / f"eu-{i}.log", "wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "rollout_worker"],
                    env=env,
                    cwd=tmp_path,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

        def logs() -> str:
            return "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                for p in sorted(tmp_path.glob("eu-*.log"))
            )

        async def until_all(v: int, timeout: float):
            deadline = time.monotonic() + timeout
            while not all(patched.get(f"eu-{i}", -1) >= v for i in range(2)):
                dead = [p.returncode for p in procs if p.poll() is not None]
                assert not dead and time.monotonic() < deadline, f"v{v} not everywhere: {patched}\n{logs()}"
                await asyncio.sleep(0.05)

        await until_all(0, 40)

        for v in range(1, 2):  # (one version: two processes starting torch dominate the time)
            new = _step(state, 0.2, v)
            d = delta_codec.encode_delta(state, new, from_version=v - 1, to_version=v)
            size = len(d.to_bytes())
            await asyncio.sleep(0.6)  # heartbeats and the mirror's idle traffic only
            before = await lab.counters()
            await pub.publish_delta(d)
            await until_all(v, 20)
            await asyncio.sleep(0.3)
            after = await lab.counters()
            state = new
            down = after["eu"]["down"]["bytes"] - before["eu"]["down"]["bytes"]
            assert size < down < 1.5 * size, (v, down, size)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        await lab.close()


async def test_python_m_bus_regions_declares_a_regions_mirrors(tmp_path):
    """The one-shot an operator (or compose's region-mirrors) runs: env in, mirrors declared with
    that retention on the region's own domain, idempotent; a bad retention is refused before
    anything is touched."""
    import json
    import subprocess
    import sys

    from bus import BusConfig, connect
    from bus.weights.regions import mirror_status

    lab = Lab(tmp_path, {"eu": LinkSpec(delay_ms=5)}, mirrors=False)
    await lab.start()
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {
            **os.environ,
            "PYTHONPATH": root,
            "ASYNCRL_BUS__SERVERS": lab.regions["eu"].url,
            "ASYNCRL_MIRROR__WEIGHTS_KEEP": "7",
            "ASYNCRL_MIRROR__STORAGE": "memory",
        }

        def run(**extra):
            return subprocess.run(
                [sys.executable, "-m", "bus.weights.regions"],
                env={**env, **extra},
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            )

        bad = run(ASYNCRL_MIRROR__WEIGHTS_KEEP="0")
        assert bad.returncode != 0 and "weights_keep" in bad.stderr
        first, again = run(), run()
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout.splitlines()[-1]) == {
            topo.WEIGHTS: "created",
            topo.BLOB_STREAM: "created",
        }
        assert json.loads(again.stdout.splitlines()[-1]) == {
            topo.WEIGHTS: "unchanged",
            topo.BLOB_STREAM: "unchanged",
        }
        b = await connect(BusConfig(servers=[lab.regions["eu"].url], name="check"))
        try:
            assert (await b.js.stream_info(topo.WEIGHTS)).config.max_msgs_per_subject == 7
            assert not any(s.get("missing") for s in (await mirror_status(b.js)).values())
        finally:
            await b.close()
    finally:
        await lab.close()
