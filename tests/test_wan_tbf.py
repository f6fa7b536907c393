"""The kernel's tbf as a WAN link's rate cap (bench.wantbf): a veth pair between two network
namespaces the test creates, shaped both ways, under the delay line (which keeps the latency).
Needs root, `ip`, `tc` and sch_tbf; skipped cleanly otherwise (bench.wan then falls back to the
delay line's own token bucket). The namespaces are deleted whatever happens."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from bench.delayline import DelayLine, LinkSpec
from bench.wantbf import TbfPath, tbf_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_tbf = pytest.mark.skipif(
    not tbf_available(), reason="tbf in network namespaces needs root, ip, tc, sch_tbf"
)


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


async def _sink_and_source(n_down: int):
    """A loopback server: reads a length and that many bytes, answers with the byte count, then
    sends n_down bytes (the delay line does not carry a half-close)."""

    async def serve(r, w):
        n = int.from_bytes(await r.readexactly(8), "big")
        got = len(await r.readexactly(n))
        w.write(got.to_bytes(8, "big") + bytes(n_down))
        await w.drain()
        w.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


def test_tbf_rejects_a_bad_rate():
    with pytest.raises(ValueError, match="rate_mbit"):
        TbfPath(rate_mbit=0)


@needs_tbf
async def test_tbf_path_caps_both_directions_and_cleans_up():
    rate_mbit, n = 16.0, 1_500_000  # 2 MB/s: 0.75 s a direction
    srv, port = await _sink_and_source(n)
    before = _netns()
    path = await TbfPath(rate_mbit).start("127.0.0.1", port)
    line = DelayLine("127.0.0.1", port, LinkSpec(delay_ms=5), connect=path.open)
    lport = await line.start()
    try:
        assert {path.ns_a, path.ns_b} <= _netns()
        r, w = await asyncio.open_connection("127.0.0.1", lport)
        t0 = time.monotonic()
        w.write(n.to_bytes(8, "big") + bytes(n))
        await w.drain()
        got = int.from_bytes(await asyncio.wait_for(r.readexactly(8), 20), "big")
        t_up = time.monotonic() - t0
        t0 = time.monotonic()
        await asyncio.wait_for(r.readexactly(n), 20)
        t_down = time.monotonic() - t0
        assert got == n
        want = n * 8 / (rate_mbit * 1e6)
        # the kernel paces: neither direction much faster than the rate (burst 128 kB), nor
        # much slower (2 cores shared: generous on the slow side)
        for t in (t_up, t_down):
            assert 0.8 * want < t < 1.6 * want + 0.2, (t_up, t_down, want)
        c = line.counters()
        assert c["up"]["bytes"] == c["down"]["bytes"] == n + 8
        print(f"tbf {rate_mbit} Mbit: up {n / t_up * 8e-6:.1f} Mbit/s, down {n / t_down * 8e-6:.1f} Mbit/s")
        w.close()
    finally:
        await line.close()
        await path.close()
        srv.close()
    assert not ({path.ns_a, path.ns_b} & _netns()) and _netns() == before


@needs_tbf
async def test_delayline_process_with_tbf_deletes_its_namespaces_on_exit():
    srv, port = await _sink_and_source(0)
    before = _netns()
    p = subprocess.Popen(
        [sys.executable, "-m", "bench.delayline"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        text=True,
    )
    try:
        p.stdin.write(
            json.dumps({"r": {"target": ["127.0.0.1", port], "delay_ms": 1, "rate_mbit": 8, "tbf": True}})
            + "\n"
        )
        p.stdin.flush()
        lport = (await asyncio.to_thread(lambda: json.loads(p.stdout.readline())))["ports"]["r"]
        assert len(_netns() - before) == 2
        r, w = await asyncio.open_connection("127.0.0.1", lport)
        w.write((3).to_bytes(8, "big") + b"abc")
        assert int.from_bytes(await asyncio.wait_for(r.readexactly(8), 10), "big") == 3
        w.close()
        p.terminate()  # SIGTERM: exits through atexit
        await asyncio.to_thread(p.wait, 20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        srv.close()
        leaked = {n for n in _netns() - before if n.startswith(f"wan{p.pid}x")}
        for n in leaked:  # killed: it could not clean up itself
            subprocess.run(["ip", "netns", "del", n])
    assert not leaked and _netns() == before


def test_lab_link_must_be_proxy_or_tbf(tmp_path):
    from bench.wanlab import Lab

    with pytest.raises(ValueError, match="proxy"):
        Lab(tmp_path, {}, link="netem")


@needs_tbf
async def test_region_mirror_fills_through_a_tbf_link(tmp_path):
    """bench.wanlab with link="tbf": the region's leaf link crosses the shaped veth; a blob put on
    the hub reaches the region's mirror at about the tbf rate (the delay line: latency only)."""
    from bench.wanlab import Lab

    rate_mbit, size = 16.0, 1_000_000
    before = _netns()
    lab = Lab(tmp_path, {"eu": LinkSpec(delay_ms=5, rate_mbit=rate_mbit)}, link="tbf")
    try:
        await lab.start()
        assert len(_netns() - before) == 2
        hub = await lab.hub_bus("trainer")
        _, src = await lab.worker_bus("eu", "w", read="mirror")
        data = os.urandom(size)  # incompressible: the leaf link compresses (s2)
        t0 = time.monotonic()
        await hub.put_blob("big", data)
        assert await src.get_blob("big") == data
        took = time.monotonic() - t0
        want = size * 8 / (rate_mbit * 1e6)
        assert 0.8 * want < took < 2.0 * want + 1.0, (took, want)
        assert (await lab.counters())["eu"]["down"]["bytes"] > size
    finally:
        await lab.close()
    assert _netns() == before
