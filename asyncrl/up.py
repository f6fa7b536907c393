"""`asyncrl up`: the whole system on one machine, as separate OS processes.

nats-server (embedded, or --nats URL) + 1 trainer + N rollout workers + M scorers. Each
process gets its own TOML (a section of the run config plus the bus address) and writes
structlog JSON to runs/<id>/logs/. This launcher only watches: it subscribes to the
telemetry subjects, shows live progress, records metrics JSONL per component, stops the
run after --steps versions or --minutes, then evaluates and plots.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from bus import BusConfig, EmbeddedServer, connect, get_logger, setup_logging
from bus import topology as topo
from bus.events import EventError, decode

from asyncrl import config_check, metrics_ports, tracking

log = get_logger("asyncrl.up")


@dataclass
class Proc:
    name: str
    component: str
    popen: subprocess.Popen
    log_path: Path


@dataclass
class Telemetry:
    """Latest values per component id, plus every metrics event appended to JSONL."""
    run_dir: Path
    t0: float = field(default_factory=time.time)
    latest: dict = field(default_factory=dict)   # component_id -> dict
    files: dict = field(default_factory=dict)
    tracker: object = None                        # asyncrl.tracking.Tracker when [up] wandb_project is set

    def record(self, component: str, cid: str, values: dict, persist: bool = True) -> None:
        now = time.time()
        values = {"t": round(now - self.t0, 3), "ts": now, **values}
        self.latest[cid] = {**self.latest.get(cid, {}), "component": component, **values}
        if self.tracker is not None:     # W&B gets heartbeats too: the scorers send nothing else
            self.tracker.log(component, cid, values)
        if not persist:
            return
        if component == "trainer":      # the trainer writes its own metrics/trainer.jsonl (run_dir)
            return
        f = self.files.get(cid)
        if f is None:
            f = self.files[cid] = open(self.run_dir / "metrics" / f"{component}-{cid}.jsonl", "a")
        f.write(json.dumps(values, default=float) + "\n")
        f.flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        if self.tracker is not None:
            self.tracker.close()


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} to TOML")


def write_toml(path: Path, data: dict) -> None:
    """Tiny TOML writer (tomllib reads only): scalars first, then one table per nested dict."""
    lines: list[str] = []

    def emit(prefix: str, d: dict) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in d.items() if isinstance(v, dict)}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in scalars.items())
        lines.append("")
        for k, v in tables.items():
            emit(f"{prefix}.{k}" if prefix else k, v)

    emit("", data)
    path.write_text("\n".join(lines))


def spawn(run_dir: Path, name: str, component: str, module: str, conf: dict, nice: int = 0) -> Proc:
    cfg_path = run_dir / "config" / f"{name}.toml"
    conf = metrics_ports.assign(run_dir, name, component, conf)     # [up] metrics_port: one /metrics each
    write_toml(cfg_path, conf)
    log_path = run_dir / "logs" / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ASYNCRL_LOG_JSON": "1",
           # 2-core box: one intra-op thread per process keeps N processes from thrashing
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           # the delta codec defaults to every core; here every process shares them
           "ASYNCRL_DELTA_THREADS": os.environ.get("ASYNCRL_DELTA_THREADS", "1")}
    out = open(log_path, "ab")
    p = subprocess.Popen([sys.executable, "-m", module, "--config", str(cfg_path)],
                         stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                         preexec_fn=(lambda: os.nice(nice)) if nice else None)
    return Proc(name, component, p, log_path)


def stop_all(procs: list[Proc], grace_s: float = 20.0) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


def progress_table(tel: Telemetry, elapsed: float, steps: int):
    from rich.table import Table

    t = Table(title=f"asyncrl up — {elapsed:5.0f}s", expand=False)
    for col in ("component", "version", "reward", "success", "tokens/answer", "λ",
                "staleness", "tok/s", "slots", "stall p99 ms", "delta KB"):
        t.add_column(col, justify="right")
    f = lambda v, fmt="{:.3f}": "-" if v is None else fmt.format(v)  # noqa: E731
    for cid, m in sorted(tel.latest.items(), key=lambda kv: (kv[1]["component"], kv[0])):
        t.add_row(f"{m['component']}:{cid[-6:]}", f(m.get("version"), "{}") + (f"/{steps}" if m["component"] == "trainer" else ""),
                  f(m.get("reward_mean")), f(m.get("success_mean")), f(m.get("cost_mean"), "{:.1f}"),
                  f(m.get("lambda"), "{:.4f}"), f(m.get("staleness_mean"), "{:.2f}"),
                  f(m.get("tokens_per_s"), "{:.0f}"), f(m.get("slot_occupancy"), "{:.0%}"),
                  f(m.get("update_stall_ms_p99"), "{:.1f}"), f(m.get("delta_bytes") and m["delta_bytes"] / 1024, "{:.1f}"))
    return t


async def watch(bus, tel: Telemetry, steps: int, minutes: float, procs: list[Proc], live) -> str:
    """Run until the trainer reaches `steps` versions, time runs out, or the trainer dies."""
    async def on_msg(msg):
        try:
            ev = decode(msg.data)
        except EventError:
            return
        values = dict(getattr(ev, "values", None) or getattr(ev, "metrics", {}) or {})
        if getattr(ev, "version", -1) not in (None, -1):
            values.setdefault("version", ev.version)
        # Metrics events are the record; heartbeats only refresh the live table
        tel.record(ev.component, ev.component_id, values, persist=ev.KIND == "Metrics")

    subs = [await bus.nc.subscribe("rl.metrics.>", cb=on_msg),
            await bus.nc.subscribe("rl.heartbeat.>", cb=on_msg)]
    t0 = time.time()
    try:
        while True:
            await asyncio.sleep(1.0)
            if live is not None:
                live.update(progress_table(tel, time.time() - t0, steps))
            raw = await bus.kv_get(topo.KEY_VERSION)
            version = int(raw) if raw else 0
            if version >= steps:
                return f"reached {version} versions"
            if time.time() - t0 > minutes * 60:
                return f"time limit ({minutes} min) at version {version}"
            for component in ("trainer", "rollout_worker", "scorer"):   # a whole role gone: stop, say why
                mine = [p for p in procs if p.component == component]
                if mine and all(p.popen.poll() is not None for p in mine):
                    return (f"every {component} exited (code {mine[0].popen.returncode}; "
                            f"see {mine[0].log_path})")
    finally:
        for s in subs:
            await s.unsubscribe()


def load_run_config(path: str | None) -> dict:
    if not path:
        return {}
    with open(path, "rb") as f:
        return tomllib.load(f)


async def run(a: argparse.Namespace) -> int:
    conf = load_run_config(a.config)
    config_check.check_run(conf, sync=a.sync)      # cross-process settings agree, [up] keys known
    up = conf.get("up", {})
    steps = a.steps or up.get("steps", 30)
    minutes = a.minutes or up.get("minutes", 9.0)
    n_workers = a.workers or up.get("workers", 2)
    n_scorers = a.scorers or up.get("scorers", 1)
    sync = a.sync or up.get("sync", False)
    # co-located on one machine, the trainer is the serial part of async RL: workers run at a
    # lower CPU priority so generation fills the cycles the trainer leaves instead of slowing it
    worker_nice = int(up.get("worker_nice", 10))
    run_dir = Path(a.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}{'-sync' if sync else ''}").resolve()
    for sub in ("config", "logs", "metrics", "plots", "checkpoints"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    setup_logging("up", log_file=str(run_dir / "logs" / "up.log"))
    metrics_ports.plan(run_dir, up.get("metrics_port", 0))

    server = None
    if a.nats:
        servers = a.nats.split(",")
    else:
        server = EmbeddedServer(store_dir=str(run_dir / "nats"))
        await server.start()
        servers = [server.url]
    bus = await connect(BusConfig(servers=servers, name="asyncrl-up"))
    await bus.provision()
    lam = a.lam if a.lam is not None else up.get("lambda")
    if lam is not None:           # λ for the scorers (they watch KV rl-control/lambda live)
        await bus.kv_put(topo.KEY_LAMBDA, repr(float(lam)).encode())
    bus_conf = {"servers": servers}

    # a fixed trainer id seeds the task feeder the same way in every run (async vs sync see the same tasks)
    trainer_conf = {"trainer_id": "trainer", **conf.get("trainer", {}), "bus": bus_conf, "run_dir": str(run_dir),
                    "checkpoint_dir": str(run_dir / "checkpoints"), "mode": "sync" if sync else "async"}
    if sync:
        trainer_conf["max_lag"] = 0
    worker_conf = {**conf.get("worker", {}), "bus": bus_conf}
    if sync:
        worker_conf["max_lag"] = 0
    scorer_conf = {**conf.get("scorer", {}), "bus": bus_conf}
    (run_dir / "config" / "run.json").write_text(json.dumps(
        {"steps": steps, "minutes": minutes, "workers": n_workers, "scorers": n_scorers, "sync": sync,
         "worker_nice": worker_nice,
         "lambda": lam, "trainer": trainer_conf, "worker": worker_conf, "scorer": scorer_conf}, indent=2))

    procs = [spawn(run_dir, "trainer", "trainer", "trainer", trainer_conf)]
    procs += [spawn(run_dir, f"scorer-{i}", "scorer", "scorer", {**scorer_conf, "scorer_id": f"scorer-{i}"})
              for i in range(n_scorers)]
    procs += [spawn(run_dir, f"worker-{i}", "rollout_worker", "rollout_worker",
                    {**worker_conf, "worker_id": f"worker-{i}", "seed": 1000 + i}, nice=worker_nice)
              for i in range(n_workers)]
    tel = Telemetry(run_dir, tracker=tracking.open_tracker(run_dir, up, json.loads((run_dir / "config" / "run.json").read_text())))
    reason = "interrupted"
    try:
        if sys.stdout.isatty() and not a.quiet:
            from rich.live import Live
            with Live(progress_table(tel, 0, steps), refresh_per_second=2) as live:
                reason = await watch(bus, tel, steps, minutes, procs, live)
        else:
            reason = await watch(bus, tel, steps, minutes, procs, None)
    finally:
        log.info("stopping", reason=reason)
        stop_all(procs)
        tel.close()
        await bus.close()
        if server is not None:
            await server.stop()

    from asyncrl.report import finish_run
    summary = finish_run(run_dir, reason)
    print(json.dumps(summary, default=float))
    return 0 if summary["versions"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl up", description=__doc__)
    ap.add_argument("--config", default=None, help="run config TOML ([up], [trainer], [worker], [scorer])")
    ap.add_argument("--sync", action="store_true", help="synchronous baseline: max_lag 0 and a barrier per version")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many policy versions")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this many minutes")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--scorers", type=int, default=None)
    ap.add_argument("--lambda", dest="lam", type=float, default=None,
                    help="cost penalty λ per generated token (e.g. from `asyncrl calibrate-cost`)")
    ap.add_argument("--nats", default=None, help="use this server instead of an embedded one")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--quiet", action="store_true", help="no live table")
    return asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
