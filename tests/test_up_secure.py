"""`asyncrl up`'s embedded broker admits only the run's own processes: an
unauthenticated local client (raw nats-py) cannot connect, so cannot publish on rl.weights.>;
the credentials reach the children through their environment only (not argv, not their TOML);
the per-run signing pair and the credential files are private. Stopped as soon as it is checked
(tests/test_up.py's run checks that the versions are signed with the run's key)."""

from __future__ import annotations

import stat
import subprocess
import sys

import nats
import pytest

from bench.up_driver import child_pid, run_pids, start_up, stop_run, wait_for
from bus import topology as topo
from tests.helpers.up import SUPERVISE


def _env_file(path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


async def test_up_broker_refuses_unauthenticated_clients_and_keeps_secrets_off_argv(tmp_path):
    proc, run_dir = start_up(tmp_path, SUPERVISE, steps=500, minutes=3)
    out = tmp_path / "up.out"
    try:
        env_file = run_dir / "config" / "bus.env"
        await wait_for(
            lambda: env_file.exists() and (run_dir / "config" / "worker-1.toml").exists(),
            120,
            "broker and children started",
            proc,
            out,
        )
        creds = _env_file(env_file)
        url, user = creds["ASYNCRL_BUS__SERVERS"], creds["ASYNCRL_BUS__USER"]
        password = creds["ASYNCRL_BUS__PASSWORD"]
        assert url.startswith("nats://127.0.0.1:") and len(password) >= 32

        for kw in ({}, {"user": user, "password": "wrong"}, {"user": "admin", "password": password}):
            with pytest.raises(Exception) as e:  # refused at CONNECT: nothing can be published
                nc = await nats.connect(
                    url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False, **kw
                )
                await nc.publish(topo.DELTA_SUBJECT, b"forged delta")
                await nc.flush(timeout=2)
                await nc.close()
            assert "authorization" in repr(e.value).lower(), (kw, e.value)

        nc = await nats.connect(url, user=user, password=password, connect_timeout=5)  # the run's own
        try:
            assert (await nc.jetstream().stream_info(topo.WEIGHTS)).config.name == topo.WEIGHTS
        finally:
            await nc.close()

        # secrets: 0600 files; never on a command line, never in the children's TOML or run.json
        for p in (env_file, run_dir / "config" / "nats-auth.conf", run_dir / "keys" / "run-signing.key"):
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        for _pid, cmd in run_pids(run_dir).items():
            assert password not in cmd, cmd
        for p in list((run_dir / "config").glob("*.toml")) + [run_dir / "config" / "run.json"]:
            assert password not in p.read_text(), p
        trainer = (run_dir / "config" / "trainer.toml").read_text()
        worker = (run_dir / "config" / "worker-1.toml").read_text()
        assert f'signing_key = "{run_dir / "keys" / "run-signing.key"}"' in trainer
        assert f'public_key = "{run_dir / "keys" / "run-signing.pub"}"' in worker
        # the children do get them, in their environment
        # (the configs are all written before the children are spawned: wait for worker-1 itself)
        child = await wait_for(lambda: child_pid(run_dir, "worker-1"), 120, "worker-1 running", proc, out)
        raw = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        environ = dict(kv.split(b"=", 1) for kv in raw if b"=" in kv)
        assert environ[b"ASYNCRL_BUS__PASSWORD"].decode() == password
    finally:
        stop_run(proc, run_dir)


def test_up_refuses_a_bad_signing_key_before_starting_anything(tmp_path):
    cfg = tmp_path / "up.toml"
    cfg.write_text('[up]\nsteps = 1\n[trainer.publish]\nsigning_key = "/nonexistent/trainer.key"\n')
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "up",
            "--config",
            str(cfg),
            "--run-dir",
            str(tmp_path / "run"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "[trainer.publish] signing_key" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "nats").exists() and not list((tmp_path / "run" / "logs").glob("worker*"))
