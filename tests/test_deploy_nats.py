"""deploy/nats: the shipped server configs, run for real (3-node JetStream cluster, leaf region).
The helpers that run them on one machine are bench/chaoskit/nats_configs.py (the chaos cluster
scenario starts its cluster with them too)."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess

import nats
import pytest

from asyncrl.nats_server import find_binary
from bench.chaoskit.nats_configs import (
    NATS_DIR,
    ConfServer,
    cluster_replacements,
    free_port,
    get_json,
    render_nats_configs,
    role_bus_config,
    role_env_vars,
    role_passwords,
    wait_until,
)
from bus import TopologyConfig, connect
from bus import topology as topo
from bus.events import Task, new_id


# -- tests -----------------------------------------------------------------------------------
def test_configs_parse_with_nats_server_t(tmp_path):
    """`nats-server -t` accepts every shipped config (with the environment deploy/env supplies)."""
    passwords = role_passwords()
    env = {
        **os.environ,
        **role_env_vars(passwords),
        "ASYNCRL_NATS_HUB_LEAF_URL": "nats-leaf://127.0.0.1:7422",
    }
    confs = sorted(NATS_DIR.glob("*.conf"))
    tops = [
        c
        for c in confs
        if c.name in ("single.conf", "leaf.conf", "cluster-a.conf", "cluster-b.conf", "cluster-c.conf")
    ]
    assert len(tops) == 5, [c.name for c in confs]
    for c in tops:
        r = subprocess.run(
            [find_binary(), "-c", str(c), "-t"],
            env=env,
            cwd=NATS_DIR,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0 and "is valid" in (r.stdout + r.stderr), (c.name, r.stdout, r.stderr)
    # a missing password is a refusal to start, never an open door
    env.pop("ASYNCRL_NATS_WORKER_PASSWORD")
    r = subprocess.run(
        [find_binary(), "-c", str(NATS_DIR / "single.conf"), "-t"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode != 0 and "ASYNCRL_NATS_WORKER_PASSWORD" in (r.stdout + r.stderr)


async def test_three_node_cluster_forms_and_serves_r3_topology(tmp_path):
    passwords = role_passwords()
    conf = render_nats_configs(tmp_path / "conf", cluster_replacements(tmp_path))
    nodes = [
        ConfServer(conf / f"cluster-{n}.conf", role_env_vars(passwords), tmp_path / f"{n}.log") for n in "abc"
    ]
    try:
        await asyncio.gather(*(asyncio.to_thread(n.start) for n in nodes))

        def meta_leader():
            infos = [get_json(f"{n.monitor_url}/jsz") for n in nodes]
            metas = [i.get("meta_cluster") or {} for i in infos]
            leaders = {m.get("leader") for m in metas}
            if len(leaders) != 1 or None in leaders:
                return False
            # and every peer current and online as the leader sees it: an R3 stream placed before
            # then is refused ("no suitable peers for placement, peer offline"; seen once under load)
            # (the leader's own view lists the two other peers)
            ok = any(
                len(m.get("replicas") or []) == 2
                and all(r.get("current") and not r.get("offline") for r in m["replicas"])
                for m in metas
            )
            return ok and leaders.pop()

        leader = await asyncio.to_thread(
            wait_until, meta_leader, 30, "JetStream meta leader, every peer current"
        )
        assert leader in {"rl-a", "rl-b", "rl-c"}

        # the trainer provisions R3 streams through one node; a worker on another node reads them
        trainer = await connect(
            role_bus_config(nodes[0].url, "trainer", passwords, topology=TopologyConfig(replicas=3))
        )
        worker = await connect(role_bus_config(nodes[2].url, "worker", passwords))
        try:
            await trainer.provision()
            si = await trainer.js.stream_info(topo.TASKS)
            assert si.config.num_replicas == 3 and len(si.cluster.replicas or []) == 2
            t = Task(task_id=new_id(), env="arith", prompt="1+1")
            await trainer.publish(topo.task_subject("arith"), t)
            sub = await worker.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
            msgs = []
            for _ in range(20):
                msgs = await sub.fetch(1, timeout=0.5)
                if msgs:
                    break
            assert [m.headers["Rl-Task"] for m in msgs] == [t.task_id]
            await msgs[0].ack_sync()
        finally:
            await worker.close()
            await trainer.close()
    finally:
        await asyncio.gather(*(asyncio.to_thread(n.stop) for n in nodes))


@pytest.mark.parametrize("compromised", [False, True], ids=["shipped", "compromised-region"])
async def test_leaf_region_worker_reaches_hub_and_hub_refuses_weights(tmp_path, compromised):
    """A region's worker works through the leaf (pull tasks, publish rollouts, read KV) and
    cannot publish weights or write the lease. With `compromised`, the leaf's local worker
    login is unrestricted: the hub alone (user `region`) must still refuse."""
    passwords = role_passwords()
    leaf_port = free_port()
    replace = {"0.0.0.0:7422": f"127.0.0.1:{leaf_port}", "/var/lib/nats": str(tmp_path / "hub")}
    if compromised:
        replace["{ user: worker,   password: $ASYNCRL_NATS_WORKER_PASSWORD,   permissions: $RL_WORKER }"] = (
            "{ user: worker,   password: $ASYNCRL_NATS_WORKER_PASSWORD }\n"
            # (nats-server refuses a config with an unused variable)
            f"{{ user: spare, password: {secrets.token_hex(8)}, permissions: $RL_WORKER }}"
        )
    conf = render_nats_configs(tmp_path / "conf", replace)
    hub = ConfServer(conf / "single.conf", role_env_vars(passwords), tmp_path / "hub.log")
    hub.start("/healthz?js-enabled-only=true")
    leaf = ConfServer(
        conf / "leaf.conf",
        {**role_env_vars(passwords), "ASYNCRL_NATS_HUB_LEAF_URL": f"nats-leaf://127.0.0.1:{leaf_port}"},
        tmp_path / "leaf.log",
    ).start()
    trainer = worker = None
    try:
        await asyncio.to_thread(leaf.wait_leaf_connected)
        trainer = await connect(role_bus_config(hub.url, "trainer", passwords))
        await trainer.provision()
        await trainer.kv_put(topo.KEY_VERSION, b"7")
        t = Task(task_id=new_id(), env="arith", prompt="2+3")
        await trainer.publish(topo.task_subject("arith"), t)

        # regional clients address the hub's JetStream by domain (leaf.conf); BusConfig has no
        # domain option yet, so this worker speaks nats-py directly
        worker = await nats.connect(leaf.url, user="worker", password=passwords["worker"])
        js = worker.jetstream(domain="hub", timeout=2)
        assert (await (await js.key_value(topo.CONTROL_BUCKET)).get(topo.KEY_VERSION)).value == b"7"
        sub = await js.pull_subscribe_bind(durable=topo.ROLLOUT_CONSUMER, stream=topo.TASKS)
        msgs = await sub.fetch(1, timeout=5)
        assert [m.headers["Rl-Task"] for m in msgs] == [t.task_id]
        await msgs[0].ack_sync()
        ack = await js.publish(topo.rollout_subject("arith"), b"rollout-bytes", timeout=2)
        assert ack.stream == topo.ROLLOUTS
        assert (await trainer.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)).num_ack_pending == 0

        before = (await trainer.js.stream_info(topo.WEIGHTS)).state.messages
        await worker.publish(topo.DELTA_SUBJECT, b"forged delta")
        await worker.publish(f"$KV.{topo.CONTROL_BUCKET}.{topo.KEY_LEADER}", b"forged lease")
        await worker.flush()
        await asyncio.sleep(0.5)  # let anything that would cross the link arrive
        assert (await trainer.js.stream_info(topo.WEIGHTS)).state.messages == before == 0
        assert await trainer.kv_get(topo.KEY_LEADER) is None
    finally:
        if worker is not None:
            await worker.close()
        if trainer is not None:
            await trainer.close()
        leaf.stop()
        hub.stop()


@pytest.mark.parametrize("compromised", [False, True], ids=["shipped", "compromised-region"])
async def test_region_mirrors_under_role_based_hub_and_region_stays_a_worker(tmp_path, compromised):
    """region.conf against single.conf with its per-role users: the region's mirrors of WEIGHTS
    and the blob store fill through the hub's `region` user (RL_REGION), a region `worker`
    follows weights from them (weights_domain) while pulling work from the hub. A mirror of
    anything else stays empty, and neither the region's worker nor (with `compromised`, its
    local worker login unrestricted) the region itself can publish weights or write the lease."""
    import torch
    from nats.js import api

    import delta_codec
    from bus.weights.follower import StateTarget
    from bus.weights.publisher import WeightPublisher
    from bus.weights.regions import weight_follower

    passwords = role_passwords()
    leaf_port = free_port()
    hub_conf = render_nats_configs(
        tmp_path / "hubconf",
        {"0.0.0.0:7422": f"127.0.0.1:{leaf_port}", "/var/lib/nats": str(tmp_path / "hub")},
    )
    replace = {"/var/lib/nats": str(tmp_path / "eu")}
    if compromised:
        replace["{ user: worker,   password: $ASYNCRL_NATS_WORKER_PASSWORD,   permissions: $RL_WORKER }"] = (
            "{ user: worker,   password: $ASYNCRL_NATS_WORKER_PASSWORD }\n"
            f"{{ user: spare, password: {secrets.token_hex(8)}, permissions: $RL_WORKER }}"
        )
    region_conf = render_nats_configs(tmp_path / "euconf", replace)
    hub = ConfServer(hub_conf / "single.conf", role_env_vars(passwords), tmp_path / "hub.log")
    hub.start("/healthz?js-enabled-only=true")
    region = ConfServer(
        region_conf / "region.conf",
        {
            **role_env_vars(passwords),
            "ASYNCRL_REGION": "eu",
            "ASYNCRL_NATS_HUB_LEAF_URL": f"nats-leaf://127.0.0.1:{leaf_port}",
        },
        tmp_path / "eu.log",
    )
    buses = []
    try:
        region.start("/healthz?js-enabled-only=true")
        await asyncio.to_thread(region.wait_leaf_connected)
        trainer = await connect(role_bus_config(hub.url, "trainer", passwords))
        buses.append(trainer)
        await trainer.provision()
        pub = WeightPublisher(trainer, epoch=1, trainer_id="t", inline_max=16 * 1024)
        g = torch.Generator().manual_seed(0)
        state = {"w": torch.randn(40_000, generator=g).to(torch.bfloat16)}
        await pub.publish_keyframe(state, 0, {})  # 80 kB: through the blob store
        t = Task(task_id=new_id(), env="arith", prompt="2+3")
        await trainer.publish(topo.task_subject("arith"), t)
        from bus.events import Heartbeat

        await trainer.publish(
            topo.heartbeat_subject("trainer", "t"),
            Heartbeat(component="trainer", component_id="t", version=0),
        )

        admin = await connect(role_bus_config(region.url, "admin", passwords))  # the region's own domain
        buses.append(admin)
        assert set((await topo.provision_mirrors(admin.js, topo.MirrorConfig())).values()) == {"created"}
        ext = api.ExternalStream(api=f"$JS.{topo.HUB_DOMAIN}.API")
        await admin.js.add_stream(
            api.StreamConfig(
                name="TELEMETRY_COPY", mirror=api.StreamSource(name=topo.TELEMETRY, external=ext)
            )
        )  # not a region's to copy

        worker = await connect(
            role_bus_config(region.url, "worker", passwords, js_domain=topo.HUB_DOMAIN, weights_domain="eu")
        )
        buses.append(worker)
        target, stop = StateTarget(), asyncio.Event()
        feed = weight_follower(worker, name="eu-w")
        follow = asyncio.ensure_future(feed.follow(target, stop))
        new = {"w": (state["w"].float() * 1.01).to(torch.bfloat16)}
        await asyncio.to_thread(wait_until, lambda: target.version == 0, 20, "keyframe from eu's blob mirror")
        await pub.publish_delta(delta_codec.encode_delta(state, new, from_version=0, to_version=1))
        await asyncio.to_thread(wait_until, lambda: target.version == 1, 20, "delta from eu's WEIGHTS mirror")
        assert torch.equal(target.state["w"], new["w"]) and not feed.refused
        stop.set()
        await follow
        local = await worker.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)  # work: the hub's
        assert local.num_pending == 1
        sub = await worker.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
        msgs = await sub.fetch(1, timeout=5)
        assert [m.headers["Rl-Task"] for m in msgs] == [t.task_id]
        await msgs[0].ack_sync()

        assert (await admin.js.stream_info(topo.WEIGHTS)).state.messages == 2
        assert (await trainer.js.stream_info(topo.TELEMETRY)).state.messages >= 1
        assert (await admin.js.stream_info("TELEMETRY_COPY")).state.messages == 0

        before = (await trainer.js.stream_info(topo.WEIGHTS)).state.messages
        raw = await nats.connect(region.url, user="worker", password=passwords["worker"])
        try:
            await raw.publish(topo.DELTA_SUBJECT, b"forged delta")
            await raw.publish(f"$KV.{topo.CONTROL_BUCKET}.{topo.KEY_LEADER}", b"forged lease")
            await raw.publish(f"$JS.{topo.HUB_DOMAIN}.API.CONSUMER.MSG.NEXT.ROLLOUTS.scorer", b"1")
            await raw.flush()
        finally:
            await raw.close()
        await asyncio.sleep(0.5)  # let anything that would cross the link arrive
        assert (await trainer.js.stream_info(topo.WEIGHTS)).state.messages == before == 2
        assert await trainer.kv_get(topo.KEY_LEADER) is None
        assert (await trainer.js.consumer_info(topo.ROLLOUTS, topo.SCORER_CONSUMER)).num_waiting == 0
    finally:
        for b in buses:
            await b.close()
        region.stop()
        hub.stop()


async def test_creation_waits_out_a_forming_clusters_placement_refusal_only(monkeypatch):
    """A cluster still forming refuses a replicated stream ("no suitable peers for placement") for
    a few seconds: creation retries that refusal, and raises every other error at once."""
    from nats.js.errors import BadRequestError

    from bus import topology

    monkeypatch.setattr(topology, "PLACEMENT_WAIT_S", 5.0)
    calls = []

    async def refused_twice():
        calls.append(1)
        if len(calls) < 3:
            raise BadRequestError(code=400, err_code=10005, description="no suitable peers for placement")
        return "made"

    assert await topology._create(refused_twice) == "made" and len(calls) == 3

    async def other():
        calls.append(2)
        raise BadRequestError(code=400, err_code=10058, description="stream name already in use")

    with pytest.raises(BadRequestError) as e:
        await topology._create(other)
    assert e.value.err_code == 10058 and calls.count(2) == 1
