"""`asyncrl up` with a harness endpoint and an external broker whose URL carries a password: the run's
endpoint token is made once, in runs/<id>/config/endpoint.token (0600); the workers get its path
([worker.harness] endpoint_token_file), `up` prints where it is and never the token; the --nats URL's
password reaches the children only through their environment: neither the token nor the password is
in run.json, a child's TOML, a log or a child's command line."""

from __future__ import annotations

import stat

from asyncrl.nats_server import EmbeddedServer
from bench.up_driver import child_pid, run_pids, start_up, stop_run, wait_for
from tests.helpers.up import SUPERVISE

PASSWORD = "s3cret-broker-password-0123456789"


async def test_up_hands_the_endpoint_token_and_broker_password_to_children_only(tmp_path):
    auth = tmp_path / "nats-auth.conf"
    auth.write_text(f'authorization {{ users = [ {{ user: "ops", password: "{PASSWORD}" }} ] }}\n')
    server = EmbeddedServer(store_dir=tmp_path / "nats", config_file=str(auth)).start_sync()
    conf = SUPERVISE + '\n[worker.harness]\nkind = "external"\n'
    url = server.url.replace("nats://", f"nats://ops:{PASSWORD}@")
    proc, run_dir = start_up(tmp_path, conf, steps=500, nats=url, minutes=3)
    out = tmp_path / "up.out"
    try:
        token_file = run_dir / "config" / "endpoint.token"
        child = await wait_for(lambda: child_pid(run_dir, "worker-1"), 180, "worker-1 running", proc, out)
        await wait_for(lambda: "openai endpoint serving" in _logs(run_dir), 180, "endpoint up", proc, out)
        token = token_file.read_text().strip()
        assert len(token) >= 43 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        worker = (run_dir / "config" / "worker-1.toml").read_text()
        assert f'endpoint_token_file = "{token_file}"' in worker
        assert f"bearer token in {token_file}" in out.read_text()  # where a user's harness finds it
        files = list((run_dir / "config").glob("*.toml")) + [run_dir / "config" / "run.json", out]
        for secret in (token, PASSWORD):
            for p in files:
                assert secret not in p.read_text(), p
            assert secret not in _logs(run_dir)
            for pid, cmd in run_pids(run_dir).items():
                if pid != proc.pid:  # (up's own command line is what the user typed)
                    assert secret not in cmd, cmd
        assert "ops:" not in (run_dir / "config" / "run.json").read_text()
        raw = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        environ = dict(kv.split(b"=", 1) for kv in raw if b"=" in kv)
        assert environ[b"ASYNCRL_BUS__PASSWORD"].decode() == PASSWORD
        assert environ[b"ASYNCRL_BUS__USER"] == b"ops"
    finally:
        stop_run(proc, run_dir)
        server.stop_sync()


def _logs(run_dir) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
