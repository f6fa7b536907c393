"""`asyncrl up`: the whole system on one machine, as separate OS processes.

nats-server (embedded, or --nats URL) + trainer(s) + N rollout workers + M scorers. Each
process gets its own TOML (a section of the run config plus the bus address) and writes
structlog JSON to runs/<id>/logs/. This launcher supervises and watches: a child that dies is
restarted with backoff (asyncrl.supervisor, at most [up] max_restarts times each), the
telemetry subjects feed the live table and metrics JSONL per component; the run stops after
--steps versions or --minutes, or on SIGINT / SIGTERM / SIGHUP (a second one kills the
children at once), then the children drain, the embedded server stops last, and the summary
(with restarts per component) is written the same way in every case.
"""

from __future__ import annotations

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
from types import SimpleNamespace

import click

from asyncrl import (
    child_conf,
    children,
    config_check,
    layout,
    metrics_ports,
    run_secrets,
    thread_plan,
    tracking,
)
from asyncrl.nats_server import EmbeddedServer
from asyncrl.resume import resume_run
from asyncrl.supervisor import ChildSpec, Supervisor, child_env, write_toml
from asyncrl.upconfig import UpConfig
from bus import BusConfig, connect
from bus import topology as topo
from bus.control import format_lambda
from bus.events import EventError, decode
from kernel import get_logger, setup_logging
from kernel.cli import Command
from kernel.cli import run as run_cli
from kernel.config import ConfigError
from kernel.lifetime import EXIT_MARGIN_S, STOP_SIGNALS

log = get_logger("asyncrl.launch")


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
    latest: dict = field(default_factory=dict)  # component_id -> dict
    files: dict = field(default_factory=dict)
    tracker: object = None  # asyncrl.tracking.Tracker when [up] wandb_project is set

    def record(self, component: str, cid: str, values: dict, persist: bool = True) -> None:
        now = time.time()
        values = {"t": round(now - self.t0, 3), "ts": now, **values}
        self.latest[cid] = {**self.latest.get(cid, {}), "component": component, **values}
        if self.tracker is not None:  # W&B gets heartbeats too: the scorers send nothing else
            self.tracker.log(component, cid, values)
        if not persist:
            return
        if component == "trainer":  # the trainer writes its own metrics/trainer.jsonl (run_dir)
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


__all__ = ["UpConfig", "main", "run", "spawn", "write_toml", "Proc", "Telemetry"]


def spawn(run_dir: Path, name: str, component: str, module: str, conf: dict, nice: int = 0) -> Proc:
    """One unsupervised child (the chaos harness starts its processes this way)."""
    sup = Supervisor(run_dir)
    threads = int(child_conf.get(component, conf, "threads") or 1)
    child = sup.start(ChildSpec(name, component, module, conf, nice, threads=threads))
    return Proc(name, component, child.popen, child.log_path)


def warmstart_line(tel: Telemetry) -> str:
    """Where the trainer's warm start stopped ("" before it is done or without one)."""
    m = next((m for m in tel.latest.values() if m.get("warmstart_steps_done") is not None), None)
    if m is None:
        return ""
    line = f"warm start: {m['warmstart_steps_done']} steps ({m.get('warmstart_stopped')})"
    if m.get("warmstart_check_success_last") is not None:
        line += (
            f", train-split check {m['warmstart_check_success_last']:.2f} (until {m.get('warmstart_until')})"
        )
    return line


def progress_table(tel: Telemetry, elapsed: float, steps: int, sup: Supervisor | None = None):
    from rich.table import Table

    caption = None
    if sup is not None:
        caption = "restarts: " + ", ".join(f"{k} {v}" for k, v in sorted(sup.restarts().items()))
        down = [c.name for c in sup.children if not c.alive and not c.finished]
        if down:
            caption += "  ·  down: " + ", ".join(down)
    ws = warmstart_line(tel)
    if ws:
        caption = f"{caption}  ·  {ws}" if caption else ws
    t = Table(title=f"asyncrl up — {elapsed:5.0f}s", expand=False, caption=caption)
    for col in (
        "component",
        "version",
        "reward",
        "success",
        "tokens/answer",
        "λ",
        "staleness",
        "k3",
        "tok/s",
        "slots",
        "stall p99 ms",
        "delta KB",
    ):
        t.add_column(col, justify="right")
    f = lambda v, fmt="{:.3f}": "-" if v is None else fmt.format(v)  # noqa: E731
    for cid, m in sorted(tel.latest.items(), key=lambda kv: (kv[1]["component"], kv[0])):
        t.add_row(
            f"{m['component']}:{cid[-6:]}",
            f(m.get("version"), "{}") + (f"/{steps}" if m["component"] == "trainer" else ""),
            f(m.get("reward_mean")),
            f(m.get("success_mean")),
            f(m.get("cost_mean"), "{:.1f}"),
            f(m.get("lambda"), "{:.4f}"),
            f(m.get("staleness_mean"), "{:.2f}"),
            f(m.get("k3_mean"), "{:.1e}"),  # sampler/learner mismatch KL of this version's batch
            f(m.get("tokens_per_s"), "{:.0f}"),
            f(m.get("slot_occupancy"), "{:.0%}"),
            f(m.get("update_stall_ms_p99"), "{:.1f}"),
            f(m.get("delta_bytes") and m["delta_bytes"] / 1024, "{:.1f}"),
        )
    return t


async def watch(
    bus, tel: Telemetry, steps: int, minutes: float, sup: Supervisor, live, stop: asyncio.Event, why: dict
) -> str:
    """Run until the trainer reaches `steps` versions, time runs out, a whole role is gone for
    good, or `stop` (a signal). Replaces dead children meanwhile."""

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

    subs = [
        await bus.nc.subscribe("rl.metrics.>", cb=on_msg),
        await bus.nc.subscribe("rl.heartbeat.>", cb=on_msg),
    ]
    t0 = time.time()
    seen = {"version": 0}

    async def poll_version() -> None:  # its own task: a dead broker must not delay a stop signal
        while True:
            try:
                raw = await asyncio.wait_for(bus.kv_get(topo.KEY_VERSION), 5.0)
                seen["version"] = int(raw) if raw else 0
            except Exception as e:
                log.warning("version read failed", error=repr(e))
            await asyncio.sleep(1.0)

    poller = asyncio.create_task(poll_version())
    try:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass
            version = seen["version"]
            if stop.is_set():
                return f"interrupted by {why.get('signal', 'a signal')} at version {version}"
            sup.check()  # replaces dead children (it logs each exit and restart)
            if live is not None:
                live.update(progress_table(tel, time.time() - t0, steps, sup))
            if version >= steps:
                return f"reached {version} versions"
            if time.time() - t0 > minutes * 60:
                return f"time limit ({minutes} min) at version {version}"
            for component in ("trainer", "rollout_worker", "scorer"):  # a whole role gone: stop, say why
                gone = sup.gone(component)
                if gone:
                    return gone
    finally:
        poller.cancel()
        for s in subs:
            try:
                await s.unsubscribe()
            except Exception:
                pass  # connection already gone


async def final_eval(run_dir: Path, stop: asyncio.Event, threads: int = 1, env: dict | None = None) -> dict:
    """[up] final_eval: `python -m trainer --eval-final` (the last checkpoint) and `--eval-initial`
    (the warm start, unless the run evaluated v0) on the run's trainer config, side by side (the
    trainer's thread count each), once every child has stopped: their rows land in
    metrics/trainer.jsonl before the summary reads it. Skipped when a signal stopped the run; a
    signal during them stops them."""
    if stop.is_set():
        return {"final_eval": "skipped: a signal stopped the run"}
    log.info("final eval of the last checkpoint and of the initial policy")
    t0 = time.monotonic()
    rcs = await asyncio.gather(
        *(_eval_process(run_dir, which, stop, threads, env or {}) for which in ("final", "initial"))
    )
    took = round(time.monotonic() - t0, 1)
    failed = [
        f"{which} (exit {rc}): see logs/trainer-{which}-eval.log"
        for which, rc in zip(("final", "initial"), rcs)
        if rc != 0
    ]
    if failed:
        log.error("final eval failed", failed=failed)
        return {"final_eval": "failed: " + "; ".join(failed), "final_eval_s": took}
    return {"final_eval": "done", "final_eval_s": took}


async def _eval_process(run_dir: Path, which: str, stop: asyncio.Event, threads: int, env: dict) -> int:
    with open(run_dir / "logs" / f"trainer-{which}-eval.log", "ab") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "trainer",
            "--config",
            str(run_dir / "config" / "trainer.toml"),
            f"--eval-{which}",
            # the trainer's environment: the in-run evals' thread count, so the same sampling numerics
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env={**child_env(threads), **env},
        )
        waiter, stopper = asyncio.create_task(proc.wait()), asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            proc.terminate()
        rc = await waiter
        stopper.cancel()
    return rc


def load_run_config(path: str | None) -> dict:
    if not path:
        return {}
    with open(path, "rb") as f:
        return tomllib.load(f)


def link_latest(run_dir: Path) -> None:
    """<parent>/latest -> this run (`. runs/latest/nats.env`, `asyncrl.load_run("runs/latest")`);
    a real file or folder of that name is left alone."""
    latest = run_dir.parent / "latest"
    if latest.is_symlink() or not latest.exists():
        tmp = run_dir.parent / f".latest-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, latest)


@dataclass
class Broker:
    server: EmbeddedServer | None  # None: the user's (--nats)
    servers: list[str]
    creds: dict  # for up's own connection
    env: dict  # the children's: credentials travel in the environment, never run.json or a log


def start_broker(nats: str | None, run_dir: Path) -> Broker:
    """The user's server (--nats URL,...; ValueError on a bad one) or an embedded one with per-run
    credentials, so only this run's processes may connect (run_secrets.broker_auth)."""
    if nats:
        servers, env = run_secrets.external_broker(nats.split(","))
        creds = {k.removeprefix("ASYNCRL_BUS__").lower(): v for k, v in env.items()}
        return Broker(None, servers, creds, env)
    # own session: a terminal's Ctrl-C must not stop the broker before the children drained;
    # started from this (main) thread so its parent-death signal follows this process
    auth = run_secrets.broker_auth(run_dir)
    conf = str(auth.server_conf)
    server = EmbeddedServer(str(run_dir / "nats"), config_file=conf, own_session=True, die_with_parent=True)
    server.start_sync()
    auth.write_env_file([server.url])
    return Broker(server, [server.url], {"user": auth.user, "password": auth.password}, auth.env())


async def run(a: SimpleNamespace) -> int:
    # first: from here on a stop signal ends in the same orderly shutdown and summary
    stop, why = asyncio.Event(), {}
    sup: Supervisor | None = None

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            why["signal"] = sig.name
            log.warning("stop signal: stopping the run", signal=sig.name)
            stop.set()
        elif sup is not None:  # a second one: no more waiting for drains
            log.warning("second stop signal: killing the children", signal=sig.name)
            sup.kill_all()

    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)

    conf = load_run_config(a.config)
    try:
        if a.resume:  # same run dir, store, checkpoints and W&B run (asyncrl.resume)
            a.run_dir, conf = resume_run(a.resume, bool(a.nats), a.config)
        up = UpConfig.from_dict(conf.get("up", {}))
        resolved = config_check.check_run(conf, sync=a.sync)  # cross-process settings agree
        devices = layout.plan(conf, resolved)  # [layout]: each process its devices (None: no plan)
        n_workers = devices.worker_count(a.workers) if devices else a.workers or up.workers
        n_scorers = a.scorers or up.scorers
        # each process its share of the cores
        threads = thread_plan.plan(conf, n_workers, n_scorers, ranks=devices.ranks if devices else 1)
    except (TypeError, ValueError, ConfigError) as e:
        print(f"asyncrl up: bad configuration: {e}", file=sys.stderr)
        return 2
    for warning in config_check.warnings(resolved):
        print(f"asyncrl up: warning: {warning}", file=sys.stderr)
    steps = a.steps or up.steps
    minutes = a.minutes or up.minutes
    sync = a.sync or up.sync
    # co-located on one machine, the trainer is the serial part of async RL: workers run at a
    # lower CPU priority so generation fills the cycles the trainer leaves instead of slowing it
    worker_nice = up.worker_nice
    run_dir = Path(a.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}{'-sync' if sync else ''}").resolve()
    for sub in ("config", "logs", "metrics", "plots", "checkpoints"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    link_latest(run_dir)
    setup_logging("up", log_file=str(run_dir / "logs" / "up.log"))
    log.info("threads", plan=threads.line(n_workers, n_scorers, up.trainers))
    for line in devices.lines() if devices else ():
        log.info("devices", plan=line)
    metrics_ports.plan(run_dir, up.metrics_port)
    try:  # signed by default: a per-run key pair unless the config brings its own (run_secrets)
        conf = run_secrets.with_signing(conf, run_dir)
    except (ValueError, OSError) as e:
        print(
            f"asyncrl up: signing ([trainer.publish] signing_key, [worker.weights] public_key): {e}",
            file=sys.stderr,
        )
        return 2

    try:
        broker = start_broker(a.nats, run_dir)
    except ValueError as e:
        print(f"asyncrl up: {e}", file=sys.stderr)
        return 2
    server, servers, creds, broker_env = broker.server, broker.servers, broker.creds, broker.env
    topology = topo.TopologyConfig(weights_keep=up.weights_keep)
    bus = await connect(BusConfig(servers=servers, name="asyncrl-up", topology=topology, **creds))
    await bus.provision()
    lam = a.lam if a.lam is not None else up.lambda_
    if lam is not None:  # λ for the scorers (they watch KV rl-control/lambda live)
        await bus.kv_put(topo.KEY_LAMBDA, format_lambda(lam))
    token_file = None
    if resolved["worker"].harness.kind != "builtin" and not resolved["worker"].harness.endpoint_token_file:
        # the run's endpoint token: a file (0600) the workers and the user's harness read
        token_file = str(run_secrets.endpoint_token(run_dir))
        print(
            f"asyncrl up: the workers' OpenAI-compatible endpoint takes the bearer token in "
            f"{token_file} (Authorization: Bearer <token>)",
            file=sys.stderr,
        )
        log.info("endpoint token", file=token_file)
    facts = children.RunFacts(run_dir, servers, up.weights_keep, up.grace_s, sync, threads, token_file)
    child_tables = children.tables(conf, resolved, facts)
    trainer_conf, worker_conf, scorer_conf = (child_tables[k] for k in ("trainer", "worker", "scorer"))
    (run_dir / "config" / "run.json").write_text(
        json.dumps(
            {
                "steps": steps,
                "minutes": minutes,
                "workers": n_workers,
                "scorers": n_scorers,
                "sync": sync,
                "worker_nice": worker_nice,
                "trainers": up.trainers,
                "grace_s": up.grace_s,
                "max_restarts": up.max_restarts,
                "restart_backoff_s": up.restart_backoff_s,
                "lambda": lam,
                "layout": devices.to_dict() if devices else None,
                "nats_external": bool(a.nats),
                "source": conf,
                "trainer": trainer_conf,
                "worker": worker_conf,
                "scorer": scorer_conf,
            },
            indent=2,
        )
    )

    sup = Supervisor(
        run_dir,
        max_restarts=up.max_restarts,
        backoff_s=up.restart_backoff_s,
        env=broker_env or None,
    )  # the broker's credentials: environment only
    specs = children.specs(child_tables, up.trainers, n_scorers, n_workers, threads, worker_nice)
    if devices is not None:  # the trainer group under torchrun, each child on its devices
        specs = devices.apply(specs)
    for spec in specs:  # [up] metrics_port: one /metrics port per child, listed for Prometheus
        spec.conf = metrics_ports.assign(run_dir, spec.name, spec.component, spec.conf)
    tel = Telemetry(
        run_dir,
        tracker=tracking.open_tracker(
            run_dir, conf.get("up", {}), json.loads((run_dir / "config" / "run.json").read_text())
        ),
    )
    reason = f"interrupted by {why.get('signal', 'a signal')} before the run started"
    try:
        if not stop.is_set():
            for spec in specs:
                sup.start(spec)
            if sys.stdout.isatty() and not a.quiet:
                from rich.live import Live

                with Live(progress_table(tel, 0, steps, sup), refresh_per_second=2) as live:
                    reason = await watch(bus, tel, steps, minutes, sup, live, stop, why)
            else:
                reason = await watch(bus, tel, steps, minutes, sup, None, stop, why)
    finally:
        # order matters: children drain against a live broker, the broker goes last
        log.info("stopping", reason=reason)
        child_grace = max(
            [float(child_conf.get(s.component, s.conf, "grace_s", up.grace_s)) for s in specs] or [up.grace_s]
        )
        await sup.stop(child_grace + EXIT_MARGIN_S + 1.0)
        tel.close()
        try:
            await asyncio.wait_for(bus.close(), 10.0)
        except Exception as e:
            log.warning("bus close failed", error=repr(e))
        if server is not None:
            server.stop_sync()

    extra = sup.report()
    if up.final_eval and devices is not None and not devices.trainer:
        extra["final_eval"] = "skipped: the trainer runs on another node ([layout] trainer_devices = [])"
    elif up.final_eval:  # on the trainer's first device ([layout]), one process (it reads shards too)
        env = devices.env(devices.trainer[:1]) if devices else {}
        extra.update(await final_eval(run_dir, stop, threads.trainer, env))
    from asyncrl.report import finish_run

    summary = finish_run(run_dir, reason, extra=extra)
    print(json.dumps(summary, default=float), flush=True)
    return 0 if summary["versions"] else 1


@click.command("up", cls=Command, help=__doc__)
@click.option("--config", default=None, help="run config TOML ([up], [trainer], [worker], [scorer])")
@click.option("--sync", is_flag=True, help="synchronous baseline: max_lag 0 and a barrier per version")
@click.option("--steps", type=int, default=None, help="stop after this many policy versions")
@click.option("--minutes", type=float, default=None, help="stop after this many minutes")
@click.option("--workers", type=int, default=None)
@click.option("--scorers", type=int, default=None)
@click.option(
    "--lambda",
    "lam",
    type=float,
    default=None,
    help="cost penalty λ per generated token (e.g. from `asyncrl calibrate-cost`)",
)
@click.option("--nats", default=None, help="use this server instead of an embedded one")
@click.option("--run-dir", default=None)
@click.option(
    "--resume",
    default=None,
    metavar="RUN_DIR",
    help="continue a stopped run (its store, checkpoints, W&B run and config)",
)
@click.option("--quiet", is_flag=True, help="no live table")
def cli(**flags) -> int:
    return asyncio.run(run(SimpleNamespace(**flags)))


def main(argv: list[str] | None = None) -> int:
    return run_cli(cli, argv, "asyncrl up")


if __name__ == "__main__":
    sys.exit(main())
