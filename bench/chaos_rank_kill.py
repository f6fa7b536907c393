"""Chaos scenario `trainer_rank_kill`: the trainer group under torchrun's elastic agent loses a
node mid-step and re-forms with the spare.

Three elastic agents (`python -m trainer --elastic`, nnodes 2:2, one rank each, gloo on CPU,
c10d rendezvous on loopback) train as one sharded (FSDP2) group of two; the third waits as a
spare. When the group is busy (the victim rank is burning CPU) we SIGKILL one rank together with
its agent (the node is gone; the agent hosting the rendezvous store is never the victim). The
surviving rank's next collective fails, its agent re-rendezvouses, the spare joins; the new rank 0
takes the leader lease (after the TTL: the dead rank may have held it), resumes from the last
complete sharded checkpoint and goes on. Reported: seconds from the kill to the next published
version, lost / duplicated rollouts (books as in bench/chaos_harness.py), gaps and forks in the
version line, epochs, whether the spare took part."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bus import EmbeddedServer

from .chaos_harness import (BATCH_GROUPS, GROUP, LEASE_TTL_S, MODEL, RATE, ChaosError, Fleet, first_version_by,
                            row, version_line, wait_ready, weights_history)

GROUP_ID = "G"                  # the trainer group's lease holder name (all its rank 0s)
NNODES = "2:2"


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return []


def cpu_ticks(pid: int) -> int:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])            # utime + stime
    except (FileNotFoundError, IndexError, ValueError):
        return -1


def agent_conf(fleet: Fleet, port: int, **over) -> dict:
    return {"trainer_id": GROUP_ID, "model": dict(MODEL), "batch_groups": BATCH_GROUPS, "group_size": GROUP,
            "max_lag": 1000, "feed": False, "lr": 1e-3, "fetch_timeout_s": 0.3, "keyframe_interval": 1000,
            "lease_ttl_s": LEASE_TTL_S, "lease_renew_s": 1.0, "grace_s": 3.0, "device": "cpu",
            "checkpoint_dir": str(fleet.run_dir / "ckpt"), "run_dir": str(fleet.run_dir / f"trainer-{GROUP_ID}"),
            "keep_checkpoints": 3, "bus": fleet.bus_conf("trainer", GROUP_ID),
            "elastic_nnodes": NNODES, "elastic_rdzv_endpoint": f"127.0.0.1:{port}",
            "elastic_rdzv_id": f"chaos-{port}", "elastic_max_restarts": 5,
            # a dead node leaves the rendezvous after 3 missed 1 s heartbeats (default 3 x 5 s)
            "elastic_rdzv_conf": "join_timeout=300,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
            **over}


def start_agent(fleet: Fleet, name: str, conf: dict):
    """One node: `python -m trainer --elastic` (it execs torchrun), in a session of its own."""
    from asyncrl.supervisor import write_toml
    from asyncrl.up import Proc
    cfg_path = fleet.run_dir / "config" / f"{name}.toml"
    write_toml(cfg_path, conf)
    log_path = fleet.run_dir / "logs" / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ASYNCRL_LOG_JSON": "1", "OMP_NUM_THREADS": "1",
           "ASYNCRL_DELTA_THREADS": "1"}
    with open(log_path, "ab") as out:
        p = subprocess.Popen([sys.executable, "-m", "trainer", "--elastic", "--config", str(cfg_path)],
                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
    proc = Proc(name, "trainer_agent", p, log_path)
    fleet.procs[name] = proc
    return proc


async def wait_log(paths, text: str, timeout_s: float) -> None:
    t0 = time.monotonic()
    while not any(text in p.read_text(errors="replace") for p in paths):
        if time.monotonic() - t0 > timeout_s:
            raise ChaosError(f"no {text!r} in {[str(p) for p in paths]} after {timeout_s}s:\n"
                             + "\n".join(p.read_text(errors="replace")[-1500:] for p in paths))
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


async def trainer_rank_kill(run_dir: Path, tasks: int = 60, seed: int = 14) -> dict:
    """SIGKILL one rank of the elastic trainer group (and its node's agent) mid-step: the group
    re-forms with the spare from the last sharded checkpoint; versions go on with no gap or fork,
    no rollout lost or trained twice. recovery_s = kill -> next published version."""
    run_dir = Path(run_dir)
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        agents = []
        try:
            port = free_port()
            conf = agent_conf(fleet, port)
            agents.append(start_agent(fleet, "node0", {**conf, "elastic_rdzv_host": True}))   # hosts the store
            await asyncio.sleep(1.0)
            agents += [start_agent(fleet, f"node{i}", conf) for i in (1, 2)]
            fleet.scorer("s0")
            fleet.worker("w0")
            await wait_ready(fleet, ["s0", "w0"])
            await wait_log([a.log_path for a in agents], '"leading"', 300)
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            await fleet.wait_version(3, 300, watch=[a.name for a in agents])
            members = {a.name: children(a.popen.pid) for a in agents}
            spare = [n for n, kids in members.items() if not kids]
            if len(spare) != 1:
                raise ChaosError(f"expected 2 nodes with a rank and 1 spare, got {members}")
            victim = next(a for a in agents[1:] if members[a.name])      # never the store's host
            rank_pid = members[victim.name][0]
            busy = await wait_busy(rank_pid)
            victim.popen.send_signal(signal.SIGKILL)        # the node: its agent ...
            os.kill(rank_pid, signal.SIGKILL)               # ... and its rank, mid-step
            victim.popen.wait()
            t_kill = time.time()
            v_kill = await fleet.version()
            first_s, first_v = await first_version_by(fleet, GROUP_ID, t_kill, 300)
            await fleet.wait_version(first_v + 2, 300, watch=[spare[0]])
            books = await fleet.wait_trained(ids, 600, feeding=feeding, with_checkpoint=True, watch=[spare[0]])
            line = version_line(await weights_history(fleet.bus))
            spare_joined = bool(children(fleet.procs[spare[0]].popen.pid))
            clean = not line["gaps"] and not line["forks"] and len(line["epochs"]) >= 2
            return row("trainer_rank_kill", books, first_s, clean and spare_joined, versions=line["top"],
                       gaps=len(line["gaps"]), forks=len(line["forks"]), epochs=len(line["epochs"]),
                       version_at_kill=v_kill, first_version_after_kill=first_v,
                       kill_to_next_version_s=round(first_s, 2), killed_while_busy=busy, spare_joined=spare_joined)
        finally:
            ranks = [k for a in agents for k in children(a.popen.pid)]
            await fleet.close()                              # SIGTERM to the agents (they stop their ranks)
            for pid in ranks:                                # a rank its agent left behind
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
