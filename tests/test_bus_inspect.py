"""asyncrl inspect: the snapshot reflects what is on the bus; render shows it."""

from __future__ import annotations

from asyncrl.inspect import render, snapshot
from bus import topology as topo
from bus.events import Task


async def test_snapshot_and_render(bus):
    for i in range(3):
        await bus.publish(topo.task_subject("arith"), Task(task_id=f"i{i}", env="arith", prompt="p"))
    sub = await bus.pull(topo.TASKS, topo.ROLLOUT_CONSUMER)
    (m,) = await sub.fetch(1, timeout=1)  # one in flight, unacked
    await bus.kv_put(topo.KEY_VERSION, b"17")
    from bus.events import Heartbeat

    for ts in (1, 2):  # two beats of one worker: only the latest is shown
        await bus.publish(
            topo.heartbeat_subject("rollout_worker", "w9"),
            Heartbeat(
                component="rollout_worker", component_id="w9", version=ts, ts=float(ts), metrics={"slots": 4}
            ),
        )
    snap = await snapshot(bus)
    (w,) = snap["components"]
    assert (w["id"], w["version"], w["metrics"]) == ("w9", 2, {"slots": 4})
    tasks = snap["streams"][topo.TASKS]
    assert tasks["messages"] == 3
    c = tasks["consumers"][topo.ROLLOUT_CONSUMER]
    assert (c["num_pending"], c["num_ack_pending"], c["num_redelivered"]) == (2, 1, 0)
    assert snap["version"] == 17 and snap["control"][topo.KEY_VERSION]["value"] == "17"
    assert snap["control"][topo.KEY_LEADER]["value"] is None and snap["missing"] == []
    for text in (render(snap), render(snap, rich=False)):
        assert "TASKS" in text and "rollout" in text and "17" in text and "w9" in text
    await m.ack_sync()


async def test_snapshot_of_unprovisioned_server_says_so(fresh_server):
    from bus import BusConfig, connect

    b = await connect(BusConfig(servers=[fresh_server.url], name="inspect"))
    try:
        snap = await snapshot(b)
        assert set(snap["missing"]) >= {topo.TASKS, topo.CONTROL_BUCKET}
        assert "missing" in render(snap, rich=False)
    finally:
        await b.close()
