"""How long a process may outlive a stop request or its parent.

    stop_on_signals(stop, grace_s)   SIGTERM / SIGINT / SIGHUP -> stop.set(), and the process is
                                     gone grace_s + EXIT_MARGIN_S later whatever it is waiting on
                                     (a dead broker, a reconnect loop, a stuck step)
    die_with_parent(sig)             a Popen preexec_fn: the child gets `sig` when its parent dies,
                                     even by SIGKILL (Linux PR_SET_PDEATHSIG; no-op elsewhere)
    await cancel_and_wait(tasks)     cancel background tasks and wait until they have ended, even
                                     when a cancel is lost (Python 3.11's wait_for, under nats-py)

The drain itself stays graceful (finish or nak held work, flush, close); the deadline is the
backstop that makes `grace_s` a promise instead of a hope.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
import threading

from kernel.log import get_logger

log = get_logger("kernel.lifetime")

# after grace_s, held work is released (nak) and the connection flushed: this long at most
EXIT_MARGIN_S = 3.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1

_armed: threading.Timer | None = None
_lock = threading.Lock()


def arm_exit_deadline(grace_s: float, code: int = 1, name: str = "") -> None:
    """os._exit(code) grace_s + EXIT_MARGIN_S from now, unless the process ended before.
    A daemon timer thread: it fires even while the event loop is blocked. Idempotent."""
    global _armed
    with _lock:
        if _armed is not None:
            return
        limit = max(float(grace_s), 0.0) + EXIT_MARGIN_S

        def expire() -> None:
            try:
                log.error("drain deadline passed; exiting now", process=name, after_s=limit)
                sys.stderr.flush()
            finally:
                os._exit(code)

        _armed = threading.Timer(limit, expire)
        _armed.daemon = True
        _armed.start()


def stop_on_signals(stop: asyncio.Event, grace_s: float, name: str = "") -> None:
    """Call from the running loop: the stop signals set `stop` and arm the exit deadline.
    A second signal while draining does not shorten the deadline (the drain keeps its time)."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        log.info("stop signal; draining", signal=sig.name, grace_s=grace_s, process=name)
        stop.set()
        arm_exit_deadline(grace_s, 128 + sig, name)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)


def die_with_parent(sig: int = signal.SIGTERM):
    """A preexec_fn for subprocess.Popen: the child is sent `sig` when the thread that spawned it
    exits (spawn from the main thread, so that means the parent process). If the parent is
    already gone when this runs, the child ends at once."""
    parent = os.getpid()

    def preexec() -> None:
        if not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl: nobody will signal us
            os._exit(1)

    return preexec


async def cancel_and_wait(tasks, retry_s: float = 0.1, log=log) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again while one runs on.
    One cancel() is not enough on Python < 3.12: asyncio.wait_for (under nats-py's request, so
    under every JetStream publish and KV read) returns the result instead of raising when the
    cancel lands after the reply arrived but before the task resumed; a `while True` heartbeat
    then publishes on forever and a plain gather() never returns (a stop that hangs). If we are
    cancelled ourselves meanwhile, what is left is cancelled once more before we go."""
    tasks = [t for t in tasks if t is not None]
    pending = {t for t in tasks if not t.done()}
    try:
        while pending:
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=retry_s)
            for t in pending:
                log.info(
                    "task still running after cancel (a lost cancel?); cancelling again",
                    task=t.get_coro().__qualname__,
                )
    finally:
        for t in pending:
            t.cancel()
    for t in tasks:  # retrieve results so nothing logs "exception never retrieved"
        if t.done() and not t.cancelled():
            t.exception()
