"""Chaos scenario `trainer_rank_kill`: the trainer group under torchrun's elastic agent loses a
node mid-step and re-forms with the spare.

Three elastic agents (`python -m trainer --elastic`, nnodes 2:2, one rank each, gloo on CPU,
c10d rendezvous on loopback) train as one sharded (FSDP2) group of two; the third waits as a
spare; the rendezvous store runs in a process of its own. When the group is busy (the victim rank
is burning CPU) we SIGKILL one rank together with its agent (the node is gone): first rank 0, the
leader, then (a replacement spare waiting) rank 1. The surviving rank's next collective fails, its
agent re-rendezvouses, the spare joins; the new rank 0 takes the leader lease (after the TTL when
the dead rank held it), resumes from the last complete sharded checkpoint and goes on. Reported:
seconds from the kill to the next published version, lost / duplicated rollouts (books as in
bench/chaoskit/books.py), gaps and forks in the version line, epochs, whether the spare took
part."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.nats_server import EmbeddedServer

from .books import row
from .fleet import ChaosError, Fleet, wait_ready
from .observe import first_version_by, version_line
from .params import BATCH_GROUPS, GROUP, LEASE_TTL_S, MODEL, RATE
from .streams import weights_history

GROUP_ID = "G"  # the trainer group's lease holder name (all its rank 0s)
NNODES = "2:2"


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return []


def cpu_ticks(pid: int) -> int:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])  # utime + stime
    except (FileNotFoundError, IndexError, ValueError):
        return -1


def agent_conf(fleet: Fleet, port: int, **over) -> dict:
    """One elastic agent's trainer config; a section in `over` ({key: value}) is merged into these."""
    conf = {
        "trainer_id": GROUP_ID,
        "policy": {"model": dict(MODEL), "device": "cpu"},
        "batch": {"groups": BATCH_GROUPS, "group_size": GROUP, "max_lag": 1000, "fetch_timeout_s": 0.3},
        "tasks": {"feed": False},
        "optim": {"lr": 1e-3},
        "publish": {"keyframe_interval": 1000},
        "lease": {"ttl_s": LEASE_TTL_S, "renew_s": 1.0},
        "run": {"grace_s": 3.0, "dir": str(fleet.run_dir / f"trainer-{GROUP_ID}")},
        "checkpoint": {"dir": str(fleet.run_dir / "ckpt"), "keep": 3},
        "bus": fleet.bus_conf("trainer", GROUP_ID),
        "elastic": {
            "nnodes": NNODES,
            "rdzv_endpoint": f"127.0.0.1:{port}",
            "rdzv_id": f"chaos-{port}",
            "max_restarts": 5,
            # a dead node leaves the rendezvous after 3 missed 1 s heartbeats (default 3 x 5 s)
            "rdzv_conf": "join_timeout=300,last_call_timeout=2,keep_alive_interval=1,"
            "keep_alive_max_attempt=3",
        },
    }
    conf.update(
        {
            k: {**conf[k], **v} if isinstance(v, dict) and isinstance(conf.get(k), dict) else v
            for k, v in over.items()
        }
    )
    return conf


def start_agent(fleet: Fleet, name: str, conf: dict):
    """One node: `python -m trainer --elastic` (it execs torchrun), in a session of its own."""
    from asyncrl.launch import Proc
    from asyncrl.supervisor import write_toml

    cfg_path = fleet.run_dir / "config" / f"{name}.toml"
    write_toml(cfg_path, conf)
    log_path = fleet.run_dir / "logs" / f"{name}.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "ASYNCRL_LOG_JSON": "1",
        "OMP_NUM_THREADS": "1",
        "ASYNCRL_DELTA_THREADS": "1",
    }
    with open(log_path, "ab") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "trainer", "--elastic", "--config", str(cfg_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    proc = Proc(name, "trainer_agent", p, log_path)
    fleet.procs[name] = proc
    return proc


async def wait_log(paths, text: str, timeout_s: float) -> None:
    t0 = time.monotonic()
    while not any(text in p.read_text(errors="replace") for p in paths):
        if time.monotonic() - t0 > timeout_s:
            raise ChaosError(
                f"no {text!r} in {[str(p) for p in paths]} after {timeout_s}s:\n"
                + "\n".join(p.read_text(errors="replace")[-1500:] for p in paths)
            )
        await asyncio.sleep(0.2)


async def wait_busy(pid: int, timeout_s: float = 60.0) -> bool:
    """Until `pid` is computing (>= 2 CPU ticks in 50 ms): a rank inside a step."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        a = cpu_ticks(pid)
        await asyncio.sleep(0.05)
        b = cpu_ticks(pid)
        if a >= 0 and b - a >= 2:
            return True
    return False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STORE = (
    "import sys, time, datetime\n"
    "from torch.distributed import TCPStore\n"
    "s = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, multi_tenant=True, wait_for_workers=False,\n"
    "             timeout=datetime.timedelta(seconds=300))\n"
    "print('rendezvous store up', flush=True)\n"
    "while True: time.sleep(3600)\n"
)


def rank_of(pid: int) -> int | None:
    """RANK from a torchrun worker's environment."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)


async def kill_node(fleet: Fleet, agents: list, rank: int) -> tuple[str, bool]:
    """SIGKILL the node whose worker has `rank`, agent and rank, once that rank is computing."""
    for a in agents:
        if a.popen.poll() is None:
            kids = children(a.popen.pid)
            if kids and rank_of(kids[0]) == rank:
                busy = await wait_busy(kids[0])
                a.popen.send_signal(signal.SIGKILL)  # the node: its agent ...
                os.kill(kids[0], signal.SIGKILL)  # ... and its rank, mid-step
                a.popen.wait()
                return a.name, busy
    raise ChaosError(f"no live node runs rank {rank}: {[(a.name, children(a.popen.pid)) for a in agents]}")


async def trainer_rank_kill(run_dir: Path, tasks: int = 60, seed: int = 14) -> dict:
    """SIGKILL one rank of the elastic trainer group (and its node's agent) mid-step, twice: first
    the leader's node (rank 0: the lease it held must expire), then, once a replacement spare
    waits, the other rank's node. Each time the group re-forms with the spare from the last sharded
    checkpoint; versions go on with no gap or fork, no rollout lost or trained twice.
    recovery_s = the longer kill -> next published version. The rendezvous store runs in a process
    of its own (as on a cluster: a stable host), so any node may die."""
    run_dir = Path(run_dir)
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        agents, store = [], None
        try:
            port = free_port()
            store = subprocess.Popen(
                [sys.executable, "-c", STORE, str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            conf = agent_conf(fleet, port)
            agents += [start_agent(fleet, f"node{i}", conf) for i in range(3)]
            fleet.scorer("s0")
            fleet.worker("w0")
            await wait_ready(fleet, ["s0", "w0"])
            await wait_log([a.log_path for a in agents], '"leading"', 300)
            ids, feeding = fleet.feed(tasks, over_s=max(tasks / RATE, 45.0))  # work left for both kills
            await fleet.wait_version(3, 300, watch=[a.name for a in agents])
            kills = []
            for n, rank in enumerate((0, 1)):
                spare = [a.name for a in agents if a.popen.poll() is None and not children(a.popen.pid)]
                if len(spare) != 1:
                    raise ChaosError(
                        f"expected 1 spare, got {[(a.name, children(a.popen.pid)) for a in agents]}"
                    )
                victim, busy = await kill_node(fleet, agents, rank)
                t_kill = time.time()
                v_kill = await fleet.version()
                # the re-formed group (the spare in it: min 2 nodes) published a version
                first_s, first_v = await first_version_by(fleet, GROUP_ID, t_kill, 300)
                kills.append(
                    {
                        "rank": rank,
                        "node": victim,
                        "version_at_kill": v_kill,
                        "first_version": first_v,
                        "kill_to_next_version_s": round(first_s, 2),
                        "busy": busy,
                        "spare_joined": bool(children(fleet.procs[spare[0]].popen.pid)),
                    }
                )
                if n == 0:  # the dead machine comes back as the next spare
                    agents.append(start_agent(fleet, "node3", conf))
                    await asyncio.sleep(3.0)
            books = await fleet.wait_trained(ids, 600, feeding=feeding, with_checkpoint=True)
            line = version_line(await weights_history(fleet.bus))
            clean = not line["gaps"] and not line["forks"] and len(line["epochs"]) >= 3
            swapped = all(k["spare_joined"] for k in kills)
            return row(
                "trainer_rank_kill",
                books,
                max(k["kill_to_next_version_s"] for k in kills),
                clean and swapped,
                versions=line["top"],
                gaps=len(line["gaps"]),
                forks=len(line["forks"]),
                epochs=len(line["epochs"]),
                spare_joined=swapped,
                kills=kills,
                kill_to_next_version_s=[k["kill_to_next_version_s"] for k in kills],
            )
        finally:
            ranks = [k for a in agents for k in children(a.popen.pid)]
            await fleet.close()  # SIGTERM to the agents (they stop their ranks)
            for pid in ranks:  # a rank its agent left behind
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if store is not None:
                store.kill()
                store.wait()
