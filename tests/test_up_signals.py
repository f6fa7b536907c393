"""Stopping `asyncrl up` the ways users and init systems do.

    SIGINT to the process group (a terminal's Ctrl-C)   the embedded broker (own session) outlives
                                                         the children's drain; summary, no traceback
    SIGTERM (timeout, systemd, docker, CI) while the     children drain within grace_s although the
    broker is dead                                       broker is gone; summary
    SIGKILL                                              the kernel stops every child and the broker
                                                         (parent-death signal); nothing is orphaned
In every case no process of the run is left grace_s + 5 s after the signal (`up` itself may
still be writing its plots and summary then; it must be gone soon after).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from bench.up_driver import kill_run, run_pids, start_up, summary_of, trainer_version, wait_for
from tests.helpers.up import SUPERVISE

GRACE_S = 3.0
CONFIG = SUPERVISE  # grace_s = 3.0 in [up]
assert f"grace_s = {GRACE_S}" in CONFIG


async def wait_gone(run_dir, pids, limit_s: float) -> float:
    """Seconds until none of `pids` (processes of the run) is alive; fails past limit_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s + 30:
        left = {p: c for p, c in run_pids(run_dir).items() if p in pids}
        if not left:
            return time.monotonic() - t0
        await asyncio.sleep(0.1)
    raise AssertionError(f"still running {limit_s + 30}s after the signal: {left}")


def children_of_run(run_dir, up_pid: int) -> set[int]:
    return {p for p in run_pids(run_dir) if p != up_pid}


def drained_cleanly(run_dir) -> list[str]:
    """Children whose log says they hit the hard drain deadline (i.e. did not drain in time)."""
    return [
        p.name
        for p in (run_dir / "logs").glob("*.log")
        if "drain deadline passed" in p.read_text(errors="replace")
    ]


def children_stopped_ts(run_dir) -> float:
    """When `up` saw its last child exit (structlog ISO UTC timestamp in up.log)."""
    import datetime as dt

    for line in (run_dir / "logs" / "up.log").read_text().splitlines():
        r = json.loads(line) if line.startswith("{") else {}
        if r.get("event") == "children stopped":
            return dt.datetime.fromisoformat(r["timestamp"].replace("Z", "+00:00")).timestamp()
    raise AssertionError("up.log has no 'children stopped'")


def broker_shutdown_ts(run_dir) -> float:
    """When the embedded nats-server began its shutdown (its log is in local time)."""
    import datetime as dt

    for line in (run_dir / "nats" / "nats-server.log").read_text().splitlines():
        if "Initiating Shutdown" in line:
            date, clock = line.split("] ", 1)[1].split()[:2]
            return dt.datetime.strptime(f"{date} {clock}", "%Y/%m/%d %H:%M:%S.%f").timestamp()
    raise AssertionError("nats-server.log has no shutdown line")


async def _running_up(tmp_path, **kw):
    proc, run_dir = start_up(tmp_path, CONFIG, steps=500, minutes=5, **kw)
    out = tmp_path / "up.out"
    await wait_for(lambda: trainer_version(run_dir) >= 1, 150, "version 1", proc, out)
    await wait_for(
        lambda: len(children_of_run(run_dir, proc.pid)) >= 4 + (0 if kw.get("nats") else 1),
        30,
        "every child running",
        proc,
        out,
    )
    return proc, run_dir, out


async def test_ctrl_c_to_the_process_group_stops_in_order_with_a_summary(tmp_path):
    proc, run_dir, out = await _running_up(tmp_path)  # embedded nats-server
    try:
        kids = children_of_run(run_dir, proc.pid)
        assert any("nats-server" in run_pids(run_dir)[p] for p in kids)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        gone_s = await wait_gone(run_dir, kids, GRACE_S + 5)
        code = await asyncio.to_thread(proc.wait, 60)
        text = out.read_text()
        assert gone_s <= GRACE_S + 5, gone_s
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        assert code == 0, text[-3000:]
        summary = json.loads(text.strip().splitlines()[-1])
        assert summary == summary_of(run_dir)
        assert summary["stopped"].startswith("interrupted by SIGINT") and summary["versions"] >= 1
        assert drained_cleanly(run_dir) == []  # the broker was there for their drain
        # the broker went last: its shutdown began after every child had exited
        assert broker_shutdown_ts(run_dir) > children_stopped_ts(run_dir)
        for name in ("worker-0", "worker-1", "scorer-0"):
            log = (run_dir / "logs" / f"{name}.log").read_text()
            assert (
                '"consumer loop stopped"' in log and "nats disconnected" not in log.split('"stop signal')[-1]
            ), (name, log[-2000:])
    finally:
        kill_run(run_dir)


async def test_sigterm_with_the_broker_dead_still_drains_within_grace(fresh_server, tmp_path):
    proc, run_dir, out = await _running_up(tmp_path, nats=fresh_server.url)
    try:
        kids = children_of_run(run_dir, proc.pid)
        fresh_server.stop_sync(kill=True)  # the broker is gone ...
        await asyncio.sleep(1.0)
        proc.send_signal(signal.SIGTERM)  # ... when the stop comes
        gone_s = await wait_gone(run_dir, kids, GRACE_S + 5)
        code = await asyncio.to_thread(proc.wait, 60)
        text = out.read_text()
        assert gone_s <= GRACE_S + 5, (gone_s, text[-2000:])
        assert "Traceback" not in text, text[-3000:]
        assert code == 0, text[-3000:]
        s = summary_of(run_dir)
        assert s["stopped"].startswith("interrupted by SIGTERM") and s["versions"] >= 1
    finally:
        kill_run(run_dir)


async def test_sigkill_of_up_leaves_no_process_behind(tmp_path):
    proc, run_dir, out = await _running_up(tmp_path)
    try:
        kids = children_of_run(run_dir, proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        gone_s = await wait_gone(run_dir, kids, GRACE_S + 5)
        assert gone_s <= GRACE_S + 5, gone_s
    finally:
        kill_run(run_dir)
