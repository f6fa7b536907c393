"""A link's bandwidth cap done by the kernel: `tbf` on a veth pair between two network namespaces.

    if tbf_available():
        path = TbfPath(rate_mbit=20)
        await path.start("127.0.0.1", hub_leaf_port)      # namespaces, veth, tbf, relay
        line = DelayLine(..., LinkSpec(delay_ms=80), connect=path.open)   # the delay line: latency
        ...
        await path.close()                                   # namespaces gone (always, also at exit)

The path is two namespaces the path creates, `A` and `B`, joined by a veth pair (10.213.0.1 in A,
10.213.0.2 in B; addresses exist only inside them), each end's egress shaped by `tbf` at
`rate_mbit`: A->B is the up direction (region to hub), B->A the down one. One process holds
sockets in three namespaces (a socket stays in the namespace it was created in; setns switches
only the calling thread, and only while a socket is made): `open()` makes a socket in A and
connects it to a listener in B, whose connections are relayed to the target from the root
namespace. So the delay line's outgoing leg crosses the veth and is paced by the kernel, with
real TCP on top (its window and the qdisc queue), instead of by the proxy's token bucket.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), `ip` and `tc` with sch_tbf; `tbf_available()` says
whether this machine has them, and bench.wan falls back to the proxy's token bucket otherwise.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import itertools
import os
import shutil
import socket
import subprocess

CLONE_NEWNET = 0x40000000
ADDR_A, ADDR_B = "10.213.0.1", "10.213.0.2"
_counter = itertools.count()
_live: set[str] = set()  # namespaces this process made and has not deleted yet


class TbfUnavailable(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise TbfUnavailable(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _tc(ns: str, *args: str) -> None:
    r = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        raise TbfUnavailable(f"tc -n {ns} {' '.join(args)}: {r.stderr.strip()}")


def _delete_netns(name: str) -> None:
    _ip("netns", "del", name, check=False)  # takes its veth end, and so the pair, with it
    _live.discard(name)


@atexit.register
def _cleanup_at_exit() -> None:
    for name in list(_live):
        _delete_netns(name)


def tbf_available() -> bool:
    """Root, `ip`/`tc`, network namespaces and sch_tbf all work here (tried for real, cleaned up)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    try:
        probe = TbfPath(rate_mbit=1)
        probe.setup()
    except TbfUnavailable:
        return False
    finally:
        with contextlib.suppress(Exception):
            probe.teardown()
    return True


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise TbfUnavailable(f"setns: {os.strerror(e)}")


@contextlib.contextmanager
def _in_netns(name: str):
    """This thread in namespace `name` for the block (no await inside: the event loop's thread)."""
    root = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(root)
    finally:
        os.close(target)
        os.close(root)


class TbfPath:
    def __init__(self, rate_mbit: float, *, burst_bytes: int = 128 * 1024, latency_ms: float = 200.0):
        if rate_mbit <= 0:
            raise ValueError(f"TbfPath.rate_mbit must be > 0, got {rate_mbit}")
        n = next(_counter)
        self.ns_a, self.ns_b = f"wan{os.getpid()}x{n}a", f"wan{os.getpid()}x{n}b"
        # burst >= one GSO segment (64 KiB on veth): tbf drops a packet larger than its bucket
        self.rate_mbit, self.burst_bytes, self.latency_ms = rate_mbit, burst_bytes, latency_ms
        self.target: tuple[str, int] | None = None
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    # -- the namespaces ----------------------------------------------------------------------------
    def setup(self) -> None:
        try:
            for ns in (self.ns_a, self.ns_b):
                _ip("netns", "add", ns)
                _live.add(ns)
            _ip(
                "link",
                "add",
                "veth-a",
                "netns",
                self.ns_a,
                "type",
                "veth",
                "peer",
                "name",
                "veth-b",
                "netns",
                self.ns_b,
            )
            for ns, dev, addr in ((self.ns_a, "veth-a", ADDR_A), (self.ns_b, "veth-b", ADDR_B)):
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            self.set_rate(self.rate_mbit, add=True)
        except BaseException:
            self.teardown()
            raise

    def set_rate(self, rate_mbit: float, *, add: bool = False) -> None:
        self.rate_mbit = rate_mbit
        for ns, dev in ((self.ns_a, "veth-a"), (self.ns_b, "veth-b")):
            _tc(
                ns,
                "qdisc",
                "add" if add else "change",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                str(self.burst_bytes),
                "latency",
                f"{self.latency_ms}ms",
            )

    def teardown(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            _delete_netns(ns)

    # -- the relay ---------------------------------------------------------------------------------
    async def start(self, target_host: str, target_port: int) -> TbfPath:
        """Namespaces up, and a listener in B relaying to the target (root namespace)."""
        self.target = (target_host, target_port)
        await asyncio.to_thread(self.setup)
        try:
            with _in_netns(self.ns_b):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ADDR_B, 0))
            s.listen(128)
            s.setblocking(False)
            self.port = s.getsockname()[1]
            self._server = await asyncio.start_server(self._relay, sock=s)
        except BaseException:
            await asyncio.to_thread(self.teardown)
            raise
        return self

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the target across the shaped veth (what DelayLine dials instead)."""
        with _in_netns(self.ns_a):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(s, (ADDR_B, self.port))
        except BaseException:
            s.close()
            raise
        return await asyncio.open_connection(sock=s)

    async def _relay(self, b_reader: asyncio.StreamReader, b_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        writers = [b_writer]
        self._writers.add(b_writer)
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target)
            writers.append(t_writer)
            self._writers.add(t_writer)

            async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()

            pumps = [
                asyncio.ensure_future(pipe(b_reader, t_writer)),
                asyncio.ensure_future(pipe(t_reader, b_writer)),
            ]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass  # the other side went, or close(): either way both are reset
        finally:
            for w in writers:
                self._writers.discard(w)
                w.transport.abort()
            self._tasks.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):  # resetting both legs ends each relay by itself
                w.transport.abort()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._server = None
        await asyncio.to_thread(self.teardown)
