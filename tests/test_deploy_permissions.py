"""Per-role NATS users of deploy/nats, against a real server run from single.conf.

Positive: every role can do its job through the real bus code (trainer provisions, feeds
tasks, publishes weights through WeightPublisher and the object store, holds the lease;
worker pulls tasks, follows weights with WeightFollower, publishes rollouts; scorer pulls
rollouts, reads λ, publishes scored; observer reads). Negative: what a role must not do is
refused by the server ("Permissions Violation") and changes nothing anywhere.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
import torch

import delta_codec
from asyncrl.inspect import snapshot as inspect_snapshot
from bench.chaoskit.nats_configs import (
    ConfServer,
    free_port,
    render_nats_configs,
    role_bus_config,
    role_env_vars,
    role_passwords,
)
from bus import BlobError, BusConfig, KVConflict, connect
from bus import topology as topo
from bus.events import Rollout, Scored, Task, new_id
from bus.weights.follower import WeightFollower
from bus.weights.publisher import WeightPublisher
from bus.weights.rules import parse_version

KV = f"$KV.{topo.CONTROL_BUCKET}"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("perm-hub")
    passwords = role_passwords()
    conf = render_nats_configs(
        tmp / "conf", {"0.0.0.0:7422": f"127.0.0.1:{free_port()}", "/var/lib/nats": str(tmp / "js")}
    )
    srv = ConfServer(conf / "single.conf", role_env_vars(passwords), tmp / "nats.log")
    srv.start("/healthz?js-enabled-only=true")
    srv.passwords = passwords
    yield srv
    srv.stop()


async def role_bus(hub, role: str, **kw):
    return await connect(role_bus_config(hub.url, role, hub.passwords, **kw))


async def provisioned(hub):
    trainer = await role_bus(hub, "trainer")
    await trainer.provision()
    return trainer


async def test_unknown_or_anonymous_clients_are_refused(hub):
    for kw in (dict(), dict(user="worker", password="not-the-password"), dict(user="nobody", password="x")):
        with pytest.raises(Exception) as ei:
            await nats.connect(
                hub.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **kw
            )
        assert "authorization" in str(ei.value).lower() or "auth" in repr(ei.value).lower(), ei.value


async def test_each_role_can_do_its_job(hub):
    trainer = await provisioned(hub)
    worker = await role_bus(hub, "worker")
    scorer = await role_bus(hub, "scorer")
    # `asyncrl inspect --nats nats://observer:<password>@host:4222`: credentials in the URL
    observer = await connect(
        BusConfig(
            servers=[hub.url.replace("nats://", f"nats://observer:{hub.passwords['observer']}@")],
            name="asyncrl-inspect",
        )
    )
    try:
        # processes declare the topology on start; against an existing one that is read-only,
        # so restricted roles pass (a missing or different topology is the trainer's to create)
        assert set((await worker.provision()).values()) == {"unchanged"}
        assert set((await scorer.provision()).values()) == {"unchanged"}

        announced = asyncio.Event()  # WeightFollower wakes on a plain subscription to rl.weights.>

        async def on_weights(_msg):
            announced.set()

        await worker.nc.subscribe("rl.weights.>", cb=on_weights)
        await worker.nc.flush()

        # trainer: lease, λ, weights (keyframe through the object store, then an inline delta)
        epoch = await trainer.kv_create(topo.KEY_LEADER, b"trainer-a")
        await trainer.kv_put(topo.KEY_LAMBDA, b"0.001")
        pub = WeightPublisher(trainer, epoch=epoch, trainer_id="trainer-a", inline_max=0)
        base = {"w": torch.zeros(8, 8, dtype=torch.bfloat16)}
        await pub.publish_keyframe(base, version=1, model_config={"tiny": True})
        new = {"w": base["w"].clone()}
        new["w"][0, :3] = 1.0
        pub.inline_max = 1 << 20
        await pub.publish_delta(delta_codec.encode_delta(base, new, from_version=1, to_version=2))
        task = Task(task_id=new_id(), env="arith", prompt="2+2", spec={"answer": 4})
        await trainer.publish(topo.task_subject("arith"), task)

        # worker: weights (blob + stream reads + wake-up subscription), KV, a task, a rollout
        feed = WeightFollower(worker, name="perm-test")
        state = await asyncio.wait_for(feed.latest_state(), 20)
        await feed.close()
        assert state.version == 2 and torch.equal(state.state["w"], new["w"]), feed.stats()
        await asyncio.wait_for(announced.wait(), 10)
        assert parse_version(await worker.kv_get(topo.KEY_VERSION)) == 2
        watch = worker.kv_watch(topo.KEY_LEADER)
        assert (await asyncio.wait_for(anext(watch), 10))[0] == b"trainer-a"
        await watch.aclose()
        tasks = await worker.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
        msg = (await tasks.fetch(1, timeout=5))[0]
        assert msg.headers["Rl-Task"] == task.task_id
        await msg.in_progress()
        ro = Rollout(
            rollout_id=f"{task.task_id}-0",
            task_id=task.task_id,
            env="arith",
            sample_index=0,
            group_size=1,
            prompt=task.prompt,
            spec=task.spec,
            prompt_ids=[1, 2],
            completion_ids=[3],
            completion_text="4",
            logprobs=[-0.1],
            token_versions=[2],
            sampling={},
            sampling_mask={},
            quant={},
            finish_reason="stop",
            cost_tokens=1,
            wall_s=0.1,
            worker_id="w1",
            epoch=epoch,
        )
        await worker.publish(topo.rollout_subject("arith"), ro)
        await msg.ack_sync()
        await worker.publish(topo.heartbeat_subject("rollout_worker", "w1"), b"alive")

        # scorer: λ, a rollout, a scored sample; a poison message goes to DLQ
        assert await scorer.kv_get(topo.KEY_LAMBDA) == b"0.001"
        rollouts = await scorer.pull(topo.ROLLOUTS, topo.SCORER_CONSUMER)
        msg = (await rollouts.fetch(1, timeout=5))[0]
        assert msg.headers["Rl-Kind"] == "Rollout"
        sc = Scored(
            rollout=ro.to_dict(),
            success=1.0,
            cost=1.0,
            lambda_=0.001,
            penalty=0.001,
            reward=0.999,
            scorer_id="s1",
        )
        await scorer.publish(topo.scored_subject("arith"), sc)
        await msg.ack_sync()

        # trainer: takes the scored sample
        scored = await trainer.pull(topo.SCORED, topo.TRAINER_CONSUMER)
        msg = (await scored.fetch(1, timeout=5))[0]
        assert msg.headers["Rl-Kind"] == "Scored"
        await trainer.dlq(msg, "permissions test: parked on purpose")

        # observer: sees state and history, without taking anything
        si = await observer.js.stream_info(topo.DLQ)
        assert si.state.messages == 1
        assert await observer.kv_get(topo.KEY_LEADER) == b"trainer-a"
        ci = await observer.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
        assert ci.num_ack_pending == 0 and ci.num_pending == 0
        snap = await inspect_snapshot(observer)
        assert not snap["missing"] and snap["version"] == 2
        assert snap["control"][topo.KEY_LEADER]["value"] == "trainer-a"
        assert snap["streams"][topo.SCORED]["consumers"][topo.TRAINER_CONSUMER]["num_ack_pending"] == 0
    finally:
        for b in (observer, scorer, worker, trainer):
            await b.close()


async def snapshot(admin) -> dict:
    """Everything a forbidden action could have changed, as the admin sees it."""
    out = {}
    for s in (
        topo.TASKS,
        topo.ROLLOUTS,
        topo.SCORED,
        topo.WEIGHTS,
        topo.DLQ,
        topo.TELEMETRY,
        f"KV_{topo.CONTROL_BUCKET}",
        f"OBJ_{topo.BLOB_BUCKET}",
    ):
        st = (await admin.js.stream_info(s)).state
        out[s] = (st.messages, st.last_seq, st.consumer_count)
    for s, c in topo.WORK_CONSUMERS.items():
        ci = await admin.js.consumer_info(s, c)
        out[f"{s}/{c}"] = (ci.num_pending, ci.num_ack_pending, ci.delivered.stream_seq)
    return out


# What each role must not do: publishes (including the JetStream API requests behind KV
# writes, blob writes, deletes, purges and pulls from another role's consumer) and subscribes.
FORBIDDEN = {
    "worker": dict(
        publish=[
            topo.DELTA_SUBJECT,
            topo.KEYFRAME_SUBJECT,
            f"{KV}.{topo.KEY_LEADER}",
            f"{KV}.{topo.KEY_VERSION}",
            f"{KV}.{topo.KEY_LAMBDA}",
            f"$O.{topo.BLOB_BUCKET}.C.forged",
            topo.task_subject("arith"),
            topo.scored_subject("arith"),
            "$JS.API.STREAM.DELETE.TASKS",
            "$JS.API.STREAM.PURGE.WEIGHTS",
            f"$JS.API.STREAM.MSG.DELETE.KV_{topo.CONTROL_BUCKET}",
            "$JS.API.CONSUMER.DELETE.TASKS.rollout",
            "$JS.API.CONSUMER.MSG.NEXT.SCORED.trainer",
            "$JS.hub.API.STREAM.DELETE.TASKS",
            "$JS.API.STREAM.UPDATE.WEIGHTS",
        ],
        subscribe=["rl.tasks.>", "rl.scored.>", ">"],
    ),
    "scorer": dict(
        publish=[
            topo.task_subject("arith"),
            topo.DELTA_SUBJECT,
            f"{KV}.{topo.KEY_LAMBDA}",
            f"{KV}.{topo.KEY_LEADER}",
            topo.rollout_subject("arith"),
            "$JS.API.CONSUMER.MSG.NEXT.TASKS.rollout",
            "$JS.API.STREAM.PURGE.SCORED",
        ],
        subscribe=["rl.tasks.>"],
    ),
    "observer": dict(
        publish=[
            topo.task_subject("arith"),
            topo.DELTA_SUBJECT,
            f"{KV}.{topo.KEY_LEADER}",
            "$JS.API.STREAM.DELETE.TASKS",
            "$JS.API.CONSUMER.DELETE.TASKS.rollout",
            "$JS.API.CONSUMER.MSG.NEXT.TASKS.rollout",
            "$JS.API.STREAM.PURGE.DLQ",
        ],
        subscribe=[],
    ),
    "trainer": dict(publish=[topo.rollout_subject("arith"), topo.scored_subject("arith")], subscribe=[]),
}


@pytest.mark.parametrize("role", sorted(FORBIDDEN))
async def test_forbidden_actions_are_refused_and_change_nothing(hub, role):
    admin = await role_bus(hub, "admin")
    await admin.provision()
    await admin.kv_put(topo.KEY_LEADER, b"the-real-leader")
    errors: list[str] = []

    async def on_error(e):
        errors.append(str(e))

    nc = await nats.connect(
        hub.url, user=role, password=hub.passwords[role], error_cb=on_error, allow_reconnect=False
    )
    try:
        before = await snapshot(admin)
        want = FORBIDDEN[role]
        for subject in want["publish"]:
            await nc.publish(subject, b'{"forged": true}', reply=nc.new_inbox())
        for subject in want["subscribe"]:
            await nc.subscribe(subject)
        await nc.flush()

        def refused(kind, subject):
            # the hub maps its own domain's API ($JS.hub.API.x) to $JS.API.x before checking
            subject = subject.lower().replace("$js.hub.api.", "$js.api.")
            return any(
                "permissions violation" in e.lower() and kind in e.lower() and f'"{subject}"' in e.lower()
                for e in errors
            )

        for _ in range(100):  # the -ERR lines arrive asynchronously
            if all(refused("publish", s) for s in want["publish"]) and all(
                refused("subscription", s) for s in want["subscribe"]
            ):
                break
            await asyncio.sleep(0.05)
        missing = [s for s in want["publish"] if not refused("publish", s)] + [
            s for s in want["subscribe"] if not refused("subscription", s)
        ]
        assert not missing, f"{role} was not refused: {missing}; errors: {errors}"
        assert nc.is_connected  # refused, not disconnected: the role keeps working
        await asyncio.sleep(0.2)
        assert await snapshot(admin) == before
        assert await admin.kv_get(topo.KEY_LEADER) == b"the-real-leader"
    finally:
        await nc.close()
        await admin.close()


async def test_worker_bus_cannot_take_the_leader_lease(hub):
    """The same refusal through the bus API a worker process holds: the write fails, the lease stays."""
    admin = await role_bus(hub, "admin")
    await admin.provision()
    await admin.kv_put(topo.KEY_LEADER, b"the-real-leader")
    worker = await role_bus(hub, "worker", request_timeout_s=1.0, publish_retries=1)
    try:
        for attempt in (
            worker.kv_put(topo.KEY_LEADER, b"me"),
            worker.kv_create("leader-2", b"me"),
            worker.kv_update(topo.KEY_LEADER, b"me", 1),
        ):
            with pytest.raises(Exception) as ei:
                await attempt
            assert not isinstance(ei.value, KVConflict)  # refused outright, not a lost race
        assert await admin.kv_get(topo.KEY_LEADER) == b"the-real-leader"
        assert await admin.kv_get("leader-2") is None
        with pytest.raises(Exception):  # noqa: B017  (whichever error nats.py raises)
            await worker.put_blob("forged-keyframe", b"x" * 100)
        with pytest.raises(BlobError):
            await admin.get_blob("forged-keyframe")
    finally:
        await worker.close()
        await admin.close()
