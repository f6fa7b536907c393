"""Child processes of `asyncrl up`: started, replaced when they die, stopped in order.

    start(spec)     its own session (a terminal's Ctrl-C reaches `up` only, which then stops
                    everything in order) and PR_SET_PDEATHSIG SIGTERM: if `up` itself is
                    SIGKILLed the kernel tells every child to drain and go (kernel.lifetime)
    check()         an unexpected exit is logged and restarted after backoff_s · 2^k (max
                    backoff_max_s), at most max_restarts times per child; a trainer that exits 0
                    has finished (max_steps) and is not restarted
    stop(wait_s)    SIGTERM to all, wait up to wait_s (each child has its own drain deadline),
                    SIGKILL what is left
Spawn and restart only from the main thread: the parent-death signal is tied to the thread
that forked.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from kernel import get_logger
from kernel.lifetime import die_with_parent

log = get_logger("asyncrl.supervisor")


def _without_none(d: dict) -> dict:
    # TOML has no null: a None value is left out (the reader's default applies)
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def write_toml(path: Path, data: dict) -> None:
    """`data` as a TOML file (tomllib only reads; tomli_w writes), None values left out."""
    path.write_text(tomli_w.dumps(_without_none(data)))


def child_env(threads: int = 1) -> dict[str, str]:
    """The environment of a process `up` starts (children, and the final eval after them), with
    `threads` intra-op threads (asyncrl.thread_plan: the processes share the machine's cores)."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "ASYNCRL_LOG_JSON": "1",
        # the plan, not `up`'s own environment: each process its share of the cores
        "OMP_NUM_THREADS": str(threads),
        # the delta codec defaults to every core; here it runs on the process's share of them
        "ASYNCRL_DELTA_THREADS": os.environ.get("ASYNCRL_DELTA_THREADS", str(threads)),
    }


@dataclass
class ChildSpec:
    name: str  # process name: config/<name>.toml, logs/<name>.log
    component: str  # trainer | rollout_worker | scorer
    module: str  # python -m <module>
    conf: dict
    nice: int = 0
    threads: int = 1  # intra-op threads: OMP_NUM_THREADS (asyncrl.thread_plan)
    env: dict = field(default_factory=dict)  # on top of the others: its devices (asyncrl.layout)
    launch: list = field(default_factory=list)  # argv between python and `-m module` (torchrun)


@dataclass
class Child:
    spec: ChildSpec
    popen: subprocess.Popen
    log_path: Path
    restarts: int = 0
    restart_at: float | None = None  # monotonic time of a scheduled restart
    gave_up: bool = False  # exited with no restarts left
    finished: bool = False  # a trainer that exited 0: its steps are done
    codes: list = field(default_factory=list)  # exit codes seen, in order

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def component(self) -> str:
        return self.spec.component


class Supervisor:
    def __init__(
        self,
        run_dir: Path,
        *,
        max_restarts: int = 5,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        env: dict[str, str] | None = None,
    ):
        self.run_dir = run_dir
        self.env = dict(env or {})  # on top of child_env(): secrets travel here, never on argv
        self.max_restarts, self.backoff_s, self.backoff_max_s = max_restarts, backoff_s, backoff_max_s
        self.children: list[Child] = []
        self.stopping = False

    # -- processes -----------------------------------------------------------------------
    def _popen(self, spec: ChildSpec) -> tuple[subprocess.Popen, Path]:
        cfg_path = self.run_dir / "config" / f"{spec.name}.toml"
        write_toml(cfg_path, spec.conf)
        log_path = self.run_dir / "logs" / f"{spec.name}.log"
        env = {**child_env(spec.threads), **self.env, **spec.env}
        pdeath = die_with_parent(signal.SIGTERM)  # SIGTERM: the child drains within its grace_s

        def preexec() -> None:
            pdeath()
            if spec.nice:
                os.nice(spec.nice)

        with open(log_path, "ab") as out:
            p = subprocess.Popen(
                [sys.executable, *spec.launch, "-m", spec.module, "--config", str(cfg_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=preexec,
            )
        return p, log_path

    def start(self, spec: ChildSpec) -> Child:
        p, log_path = self._popen(spec)
        child = Child(spec, p, log_path)
        self.children.append(child)
        log.info("started", child=spec.name, pid=p.pid)
        return child

    def check(self) -> list[str]:
        """Handle exits and due restarts; returns one line per event (for the live view)."""
        events: list[str] = []
        if self.stopping:
            return events
        now = time.monotonic()
        for c in self.children:
            if c.gave_up or c.finished:
                continue
            if c.restart_at is None and not c.alive:
                code = c.popen.returncode
                c.codes.append(code)
                if c.component == "trainer" and code == 0:
                    c.finished = True
                    log.info("trainer finished", child=c.name)
                    continue
                if c.restarts >= self.max_restarts:
                    c.gave_up = True
                    log.error(
                        "child exited; no restarts left",
                        child=c.name,
                        code=code,
                        restarts=c.restarts,
                        max_restarts=self.max_restarts,
                        log=str(c.log_path),
                    )
                    events.append(f"{c.name} exited ({code}); no restarts left")
                    continue
                delay = min(self.backoff_s * 2**c.restarts, self.backoff_max_s)
                c.restart_at = now + delay
                log.warning(
                    "child exited unexpectedly; restarting",
                    child=c.name,
                    code=code,
                    restart=c.restarts + 1,
                    backoff_s=delay,
                    log=str(c.log_path),
                )
                events.append(f"{c.name} exited ({code}); restart in {delay:.1f}s")
            if c.restart_at is not None and now >= c.restart_at:
                c.popen, _ = self._popen(c.spec)
                c.restarts += 1
                c.restart_at = None
                log.info("restarted", child=c.name, pid=c.popen.pid, restarts=c.restarts)
                events.append(f"{c.name} restarted")
        return events

    def gone(self, component: str) -> str | None:
        """Why the whole role is over (every child finished or out of restarts), else None."""
        mine = [c for c in self.children if c.component == component]
        if not mine or not all(c.gave_up or c.finished for c in mine):
            return None
        if all(c.finished for c in mine):
            return f"{component} finished (exit 0)"
        c = next(c for c in mine if c.gave_up)
        return f"every {component} exited past max_restarts (last code {c.codes[-1]}; see {c.log_path})"

    def restarts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.children:
            out[c.component] = out.get(c.component, 0) + c.restarts
        return out

    def report(self) -> dict:
        return {
            "restarts": self.restarts(),
            "max_restarts": self.max_restarts,
            "children": {
                c.name: {
                    "component": c.component,
                    "restarts": c.restarts,
                    "gave_up": c.gave_up,
                    "exit_codes": c.codes,
                }
                for c in self.children
            },
        }

    # -- stopping ------------------------------------------------------------------------
    def signal_all(self, sig: int) -> None:
        for c in self.children:
            if c.alive:
                try:
                    c.popen.send_signal(sig)
                except ProcessLookupError:
                    pass

    def kill_all(self) -> None:
        """No more waiting (a second Ctrl-C)."""
        self.stopping = True
        self.signal_all(signal.SIGKILL)

    async def stop(self, wait_s: float) -> None:
        """SIGTERM every child, wait for their drains (up to wait_s), SIGKILL the rest."""
        self.stopping = True
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while any(c.alive for c in self.children) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        late = [c.name for c in self.children if c.alive]
        if late:
            log.error(
                "children still running after their drain deadline; killing", children=late, wait_s=wait_s
            )
            self.signal_all(signal.SIGKILL)
        for c in self.children:
            c.popen.wait()  # reaped (SIGKILLed ones go at once)
        log.info("children stopped", codes={c.name: c.popen.returncode for c in self.children})
