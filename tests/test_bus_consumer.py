"""ConsumerLoop and pull semantics against a real nats-server: redelivery, DLQ, poison messages,
heartbeats, drain, capacity, and a server restart with nothing lost."""

from __future__ import annotations

import asyncio

import msgpack

from bus import BusConfig, ConsumerLoop, TopologyConfig, TransientError, connect
from bus import topology as topo
from bus.events import Task

SHORT = TopologyConfig(ack_wait_s=1.0, max_deliver=3)


async def short_bus(srv, name="c"):
    b = await connect(BusConfig(servers=[srv.url], name=name, topology=SHORT))
    await b.provision()
    return b


def task(i, env="arith"):
    return Task(task_id=f"t{i}", env=env, prompt=f"{i}+{i}")


async def run_until(loop: ConsumerLoop, cond, timeout=20.0):
    stop = asyncio.Event()
    runner = asyncio.create_task(loop.run(stop))
    try:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(runner, 15)


async def dlq_messages(bus, n, timeout=5.0):
    sub = await bus.js.pull_subscribe(topo.dlq_subject(topo.TASKS), stream=topo.DLQ)
    msgs = await sub.fetch(n, timeout=timeout)
    await sub.unsubscribe()
    return msgs


async def test_unacked_message_is_redelivered_to_another_consumer(fresh_server):
    a, b = await short_bus(fresh_server, "a"), await short_bus(fresh_server, "b")
    try:
        await a.publish(topo.task_subject("arith"), task(1))
        sa = await a.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
        (m,) = await sa.fetch(1, timeout=1)  # "a" takes it and dies silently (never acks)
        sb = await b.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
        assert await sb.fetch(1, timeout=0.3) == []  # still leased to "a"
        got = []
        for _ in range(20):
            got = await sb.fetch(1, timeout=0.5)
            if got:
                break
        assert got and got[0].metadata.num_delivered == 2 and got[0].data == m.data
        await got[0].ack_sync()
    finally:
        await a.close()
        await b.close()


async def test_malformed_body_goes_to_dlq_and_loop_keeps_going(fresh_server):
    bus = await short_bus(fresh_server)
    try:
        subj = topo.task_subject("arith")
        await bus.publish(subj, b"\xc1 not msgpack", msg_id="bad-1")
        await bus.publish(subj, msgpack.packb({"kind": "Task", "schema": 1, "env": "arith"}), msg_id="bad-2")
        await bus.publish(subj, task(1))
        seen = []

        async def handler(ev, ctx):
            seen.append(ev.task_id)

        loop = ConsumerLoop(bus, topo.TASKS, topo.ROLLOUT_CONSUMER, handler, Task, handle_signals=False)
        await run_until(loop, lambda: loop.stats.acked == 1 and loop.stats.dlq == 2)
        assert seen == ["t1"] and loop.stats.malformed == 2
        dead = await dlq_messages(bus, 2)
        reasons = sorted(m.headers["Rl-Reason"] for m in dead)
        assert "malformed msgpack" in reasons[0] + reasons[1]
        assert any("missing required field 'task_id'" in r for r in reasons)
        assert {m.headers["Rl-Stream"] for m in dead} == {topo.TASKS}
        assert {m.data for m in dead} == {
            b"\xc1 not msgpack",
            msgpack.packb({"kind": "Task", "schema": 1, "env": "arith"}),
        }
        assert (await bus.js.stream_info(topo.TASKS)).state.messages == 0  # nothing stranded
    finally:
        await bus.close()


async def test_poison_message_parked_after_max_deliver(fresh_server):
    bus = await short_bus(fresh_server)
    try:
        await bus.publish(topo.task_subject("arith"), task(666))
        await bus.publish(topo.task_subject("arith"), task(2))
        calls = {}

        async def handler(ev, ctx):
            calls[ev.task_id] = calls.get(ev.task_id, 0) + 1
            if ev.task_id == "t666":
                raise RuntimeError("boom")

        loop = ConsumerLoop(
            bus, topo.TASKS, topo.ROLLOUT_CONSUMER, handler, Task, nak_delay_s=0.05, handle_signals=False
        )
        await run_until(loop, lambda: loop.stats.dlq == 1 and loop.stats.acked == 1)
        assert calls == {"t666": SHORT.max_deliver, "t2": 1}
        (dead,) = await dlq_messages(bus, 1)
        assert "boom" in dead.headers["Rl-Reason"] and dead.headers["Rl-Deliveries"] == str(SHORT.max_deliver)
        assert dead.headers["Rl-Task"] == "t666"  # original headers kept
        assert (await bus.js.stream_info(topo.TASKS)).state.messages == 0
    finally:
        await bus.close()


async def test_transient_error_naks_then_succeeds(fresh_server):
    bus = await short_bus(fresh_server)
    try:
        await bus.publish(topo.task_subject("arith"), task(5))
        tries = []

        async def handler(ev, ctx):
            tries.append(ctx.deliveries)
            if len(tries) < 2:
                raise TransientError("not yet", delay=0.05)

        loop = ConsumerLoop(bus, topo.TASKS, topo.ROLLOUT_CONSUMER, handler, Task, handle_signals=False)
        await run_until(loop, lambda: loop.stats.acked == 1)
        assert tries == [1, 2] and loop.stats.naks == 1 and loop.stats.dlq == 0
    finally:
        await bus.close()


async def test_heartbeats_keep_long_handler_from_redelivery(fresh_server):
    bus = await short_bus(fresh_server)  # ack_wait 1 s; the handler takes 2.5 s
    try:
        await bus.publish(topo.task_subject("arith"), task(7))
        calls = []

        async def handler(ev, ctx):
            calls.append(ctx.deliveries)
            await asyncio.sleep(2.5)

        loop = ConsumerLoop(bus, topo.TASKS, topo.ROLLOUT_CONSUMER, handler, Task, handle_signals=False)
        await run_until(loop, lambda: loop.stats.acked == 1)
        assert calls == [1] and loop.stats.heartbeats >= 3
    finally:
        await bus.close()


async def test_capacity_and_concurrency_limit_fetching(fresh_server):
    bus = await short_bus(fresh_server)
    try:
        await bus.publish_many([(topo.task_subject("arith"), task(i)) for i in range(12)])
        running, peak, cap = 0, 0, {"n": 3}
        gate = asyncio.Event()

        async def handler(ev, ctx):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await gate.wait()
            running -= 1

        loop = ConsumerLoop(
            bus,
            topo.TASKS,
            topo.ROLLOUT_CONSUMER,
            handler,
            Task,
            concurrency=5,
            capacity=lambda: cap["n"] - running,
            handle_signals=False,
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(loop.run(stop))
        await asyncio.sleep(1.0)
        assert peak == 3 and loop.stats.fetched == 3  # capacity() said 3
        cap["n"] = 100
        await asyncio.sleep(1.0)
        assert peak == 5 and loop.stats.fetched == 5  # concurrency caps at 5
        gate.set()
        async with asyncio.timeout(10):
            while loop.stats.acked < 12:
                await asyncio.sleep(0.02)
        stop.set()
        await runner
        assert peak == 5
    finally:
        await bus.close()


async def test_drain_naks_unfinished_work_for_immediate_redelivery(fresh_server):
    bus = await short_bus(fresh_server)
    try:
        await bus.publish(topo.task_subject("arith"), task(9))
        started = asyncio.Event()

        async def stuck(ev, ctx):
            started.set()
            await asyncio.sleep(3600)

        loop = ConsumerLoop(
            bus, topo.TASKS, topo.ROLLOUT_CONSUMER, stuck, Task, grace_s=0.2, handle_signals=False
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(loop.run(stop))
        await asyncio.wait_for(started.wait(), 5)
        stop.set()
        stats = await asyncio.wait_for(runner, 5)
        assert stats.drained_naks == 1 and stats.acked == 0
        sub = await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
        (m,) = await sub.fetch(1, timeout=2)
        assert m.metadata.num_delivered == 2
        await m.ack_sync()
    finally:
        await bus.close()


async def test_server_restart_loses_nothing(fresh_server):
    """Publish/consume across a server restart (same store dir): client reconnects, the pull
    subscription resumes, every message is consumed exactly once after dedupe."""
    bus = await short_bus(fresh_server)
    try:
        n = 400
        got: set[str] = set()

        async def handler(ev, ctx):
            got.add(ev.task_id)

        loop = ConsumerLoop(
            bus,
            topo.TASKS,
            topo.ROLLOUT_CONSUMER,
            handler,
            Task,
            concurrency=16,
            fetch_timeout_s=0.5,
            handle_signals=False,
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(loop.run(stop))

        async def producer():
            for i in range(n):
                await bus.publish(topo.task_subject("arith"), task(i))
                if i == n // 2:
                    await fresh_server.restart(kill=True)  # a crash, not a clean shutdown
                await asyncio.sleep(0)

        await asyncio.wait_for(producer(), 60)
        async with asyncio.timeout(60):
            while len(got) < n:
                await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(runner, 15)
        assert got == {f"t{i}" for i in range(n)}
        assert (await bus.js.stream_info(topo.TASKS)).state.messages == 0
    finally:
        await bus.close()


async def test_message_whose_consumer_died_on_last_delivery_is_swept_to_dlq(fresh_server):
    """A process that dies holding the last allowed delivery gives no verdict; the server then
    stops redelivering. The sweeper (MAX_DELIVERIES advisory) parks it in DLQ instead."""
    bus = await short_bus(fresh_server)
    try:
        await bus.publish(topo.task_subject("arith"), task(13))

        async def never(ev, ctx):
            raise AssertionError("capacity 0: the loop must not take work")

        loop = ConsumerLoop(
            bus,
            topo.TASKS,
            topo.ROLLOUT_CONSUMER,
            never,
            Task,
            capacity=lambda: 0,
            handle_signals=False,
            sweep_max_deliveries=True,
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(loop.run(stop))
        crashy = await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
        deliveries = 0
        async with asyncio.timeout(20):
            while deliveries < SHORT.max_deliver:  # take every delivery, never answer
                deliveries += len(await crashy.fetch(1, timeout=0.5))
            while loop.stats.dlq < 1:  # the advisory fires when the server next tries to deliver
                assert await crashy.fetch(1, timeout=0.5) == []  # no 4th delivery
        stop.set()
        await runner
        (dead,) = await dlq_messages(bus, 1)
        assert "max_deliver reached" in dead.headers["Rl-Reason"] and dead.headers["Rl-Task"] == "t13"
        assert (await bus.js.stream_info(topo.TASKS)).state.messages == 0
    finally:
        await bus.close()


async def test_handler_event_error_parks_at_once_and_self_acked_is_fine(fresh_server):
    from bus.events import EventError

    bus = await short_bus(fresh_server)
    try:
        await bus.publish(topo.task_subject("arith"), task(1))
        await bus.publish(topo.task_subject("arith"), task(2))

        async def handler(ev, ctx):
            if ev.task_id == "t1":
                raise EventError("spec has no answer")
            await ctx.msg.ack_sync()  # settles it itself; the loop must not double-ack

        loop = ConsumerLoop(bus, topo.TASKS, topo.ROLLOUT_CONSUMER, handler, Task, handle_signals=False)
        await run_until(loop, lambda: loop.stats.dlq == 1 and loop.stats.acked == 1)
        (dead,) = await dlq_messages(bus, 1)
        assert "spec has no answer" in dead.headers["Rl-Reason"] and dead.headers["Rl-Deliveries"] == "1"
        assert (await bus.js.stream_info(topo.TASKS)).state.messages == 0
    finally:
        await bus.close()


async def test_sigterm_drains_the_loop(fresh_server):
    import os
    import signal

    bus = await short_bus(fresh_server)
    try:
        await bus.publish(topo.task_subject("arith"), task(21))
        started, release = asyncio.Event(), asyncio.Event()

        async def handler(ev, ctx):
            started.set()
            await release.wait()

        loop = ConsumerLoop(bus, topo.TASKS, topo.ROLLOUT_CONSUMER, handler, Task, grace_s=10)
        runner = asyncio.create_task(loop.run())
        await asyncio.wait_for(started.wait(), 5)
        # never send SIGTERM unless the loop's handler is in place (it would kill pytest)
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        os.kill(os.getpid(), signal.SIGTERM)  # the loop stops fetching, waits for the handler
        await asyncio.sleep(0.3)
        assert not runner.done()
        release.set()
        stats = await asyncio.wait_for(runner, 5)
        assert stats.acked == 1 and stats.drained_naks == 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler removed
    finally:
        await bus.close()
