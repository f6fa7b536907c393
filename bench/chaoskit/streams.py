"""Read what the broker stored: every message of a stream by sequence, decoded where the books
or the observers need events (WEIGHTS history, DLQ reasons, stored rollout ids)."""

from __future__ import annotations

from nats.js.errors import NotFoundError

from bus import topology as topo
from bus.events import EventError, Rollout, Scored, Task, decode


async def stream_messages(bus, stream: str, subjects: str) -> list:
    """Every message stored in `stream` (on `subjects`), in sequence order, read by sequence."""
    out, seq = [], 0
    while True:
        try:
            raw = await bus.js.get_msg(stream, seq=seq + 1, subject=subjects, next=True)
        except NotFoundError:
            return out
        seq = raw.seq
        out.append(raw)


async def weights_history(bus) -> list:
    """Every Delta/Keyframe event in WEIGHTS, in stream order."""
    return [decode(raw.data) for raw in await stream_messages(bus, topo.WEIGHTS, "rl.weights.>")]


async def weights_by_seq(bus) -> list:
    """(stream sequence, event) of every WEIGHTS message, in order."""
    return [(raw.seq, decode(raw.data)) for raw in await stream_messages(bus, topo.WEIGHTS, "rl.weights.>")]


async def dlq_entries(bus) -> list[tuple[str, str]]:
    """(subject, Rl-Reason) of every message parked in DLQ."""
    return [
        (raw.subject, (raw.headers or {}).get("Rl-Reason", ""))
        for raw in await stream_messages(bus, topo.DLQ, "rl.dlq.>")
    ]


async def dlq_task_ids(bus) -> dict[str, str]:
    """task id -> Rl-Reason of every task, rollout or scored rollout parked in DLQ."""
    out = {}
    for raw in await stream_messages(bus, topo.DLQ, "rl.dlq.>"):
        try:
            ev = decode(raw.data)
        except EventError:
            continue  # a malformed body has no task to account for
        tid = (
            ev.task_id
            if isinstance(ev, (Task, Rollout))
            else ev.rollout.get("task_id")
            if isinstance(ev, Scored)
            else None
        )
        if tid:
            out[tid] = (raw.headers or {}).get("Rl-Reason", "")
    return out


async def stored_rollout_ids(bus) -> list[str]:
    info = await bus.js.stream_info(topo.ROLLOUTS)
    out = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        try:
            out.append(decode((await bus.js.get_msg(topo.ROLLOUTS, seq)).data, Rollout).rollout_id)
        except NotFoundError:
            continue
    return out
