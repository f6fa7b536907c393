"""`asyncrl inspect`: what is on the bus right now (streams, consumers, control KV, version).

snapshot() only reads (stream/consumer info, KV gets); render() makes a table a person reads.
"""

from __future__ import annotations

import time

import nats.js.errors as jse

from bus import topology as topo

STREAMS = [topo.TASKS, topo.ROLLOUTS, topo.SCORED, topo.WEIGHTS, topo.DLQ, topo.TELEMETRY]
CONTROL_KEYS = [topo.KEY_VERSION, topo.KEY_LEADER, topo.KEY_LAMBDA, topo.KEY_CONFIG]


def _text(raw: bytes | None, limit: int = 200) -> str | None:
    if raw is None:
        return None
    try:
        s = raw.decode()
    except UnicodeDecodeError:
        return f"<{len(raw)} bytes>"
    return s if len(s) <= limit else s[:limit] + "…"


async def snapshot(bus) -> dict:
    snap: dict = {
        "ts": time.time(),
        "server": str(bus.nc.connected_url.netloc) if bus.nc.connected_url else None,
        "streams": {},
        "control": {},
        "version": None,
        "missing": [],
    }
    for name in STREAMS:
        try:
            si = await bus.js.stream_info(name)
        except jse.NotFoundError:
            snap["missing"].append(name)
            continue
        consumers = {}
        for ci in await bus.js.consumers_info(name):
            if not ci.config.durable_name:
                continue  # ephemeral readers (blob gets, watchers) are noise here
            consumers[ci.name] = {
                "num_pending": ci.num_pending,
                "num_ack_pending": ci.num_ack_pending,
                "num_redelivered": ci.num_redelivered,
                "num_waiting": ci.num_waiting,
                "delivered": ci.delivered.stream_seq if ci.delivered else None,
            }
        snap["streams"][name] = {
            "messages": si.state.messages,
            "bytes": si.state.bytes,
            "first_seq": si.state.first_seq,
            "last_seq": si.state.last_seq,
            "consumers": consumers,
        }
    try:
        kv = await bus.js.key_value(topo.CONTROL_BUCKET)  # not bus.kv_*: those provision a missing bucket
        for key in CONTROL_KEYS:
            try:
                e = await kv.get(key)
                snap["control"][key] = {"value": _text(e.value), "revision": e.revision}
            except (jse.KeyNotFoundError, jse.KeyDeletedError):
                snap["control"][key] = {"value": None, "revision": 0}
    except jse.BucketNotFoundError:
        snap["missing"].append(topo.CONTROL_BUCKET)
    snap["components"] = await _components(bus)
    v = snap["control"].get(topo.KEY_VERSION, {}).get("value")
    try:
        snap["version"] = int(v) if v is not None else None
    except ValueError:
        snap["version"] = v
    if snap["version"] is None:  # no KV value yet: the newest WEIGHTS header says it too
        try:
            last = await bus.js.get_last_msg(topo.WEIGHTS, topo.DELTA_SUBJECT)
            snap["version"] = int((last.headers or {}).get("Rl-Version", "")) if last.headers else None
        except (jse.NotFoundError, ValueError):
            pass
    return snap


async def _components(bus, limit: int = 200) -> list[dict]:
    """Latest heartbeat of each component (rl.heartbeat.<component>.<id> in TELEMETRY)."""
    from bus.events import EventError, Heartbeat, decode

    try:
        si = await bus.js.stream_info(topo.TELEMETRY, subjects_filter="rl.heartbeat.>")
    except jse.NotFoundError:
        return []
    out = []
    now = time.time()
    for subject in sorted(si.state.subjects or {})[:limit]:
        try:
            raw = await bus.js.get_last_msg(topo.TELEMETRY, subject)
            hb = decode(raw.data, Heartbeat)
        except (jse.NotFoundError, EventError):
            continue
        out.append(
            {
                "component": hb.component,
                "id": hb.component_id,
                "version": hb.version,
                "age_s": round(now - hb.ts, 1),
                "metrics": hb.metrics,
            }
        )
    return out


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render(snap: dict, rich: bool | None = None) -> str:
    """A table per section. Uses rich when available (plain text otherwise or when rich=False)."""
    rows = []
    for name, s in snap["streams"].items():
        cons = s["consumers"] or {"-": None}
        for cname, c in cons.items():
            rows.append(
                [
                    name,
                    str(s["messages"]),
                    _size(s["bytes"]),
                    cname,
                    *(
                        ["", "", ""]
                        if c is None
                        else [str(c["num_pending"]), str(c["num_ack_pending"]), str(c["num_redelivered"])]
                    ),
                ]
            )
            name = ""  # print the stream once
    head = ["stream", "msgs", "bytes", "consumer", "pending", "ack_pending", "redelivered"]
    ctl = [
        [k, "" if v["value"] is None else v["value"], str(v["revision"])] for k, v in snap["control"].items()
    ]
    comp = [
        [
            c["component"],
            c["id"],
            str(c["version"]),
            f"{c['age_s']:.1f}",
            ", ".join(f"{k}={v}" for k, v in list(c["metrics"].items())[:6])[:60],
        ]
        for c in snap.get("components", [])
    ]
    comp_head = ["component", "id", "version", "last seen (s)", "metrics"]
    title = f"asyncrl @ {snap.get('server')}  policy version: {snap.get('version')}"
    if rich is not False:
        try:
            from io import StringIO

            from rich.console import Console
            from rich.table import Table
        except ImportError:
            rich = False
    if rich is False:

        def table(h, rs):
            w = [max(len(x) for x in col) for col in zip(h, *rs)]
            return "\n".join("  ".join(c.ljust(n) for c, n in zip(r, w)) for r in [h, *rs])

        out = [title, "", table(head, rows), "", table(["key", "value", "revision"], ctl)]
        if comp:
            out += ["", table(comp_head, comp)]
        if snap["missing"]:
            out += ["", f"missing (not provisioned): {', '.join(snap['missing'])}"]
        return "\n".join(out)
    buf = StringIO()
    con = Console(file=buf, width=120, force_terminal=False)
    t = Table(title=title)
    for h in head:
        t.add_column(h, justify="right" if h not in ("stream", "consumer") else "left")
    for r in rows:
        t.add_row(*r)
    con.print(t)
    k = Table(title="KV rl-control")
    for h in ("key", "value", "revision"):
        k.add_column(h)
    for r in ctl:
        k.add_row(*r)
    con.print(k)
    if comp:
        c = Table(title="components (last heartbeat)")
        for h in comp_head:
            c.add_column(h)
        for r in comp:
            c.add_row(*r)
        con.print(c)
    if snap["missing"]:
        con.print(f"missing (not provisioned): {', '.join(snap['missing'])}")
    return buf.getvalue()
