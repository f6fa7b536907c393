"""A user who is not root: the arithmetic demo runs without the sandbox check (it runs no code),
and code runs in the rootless sandbox (a user namespace with the user's own uid mapped, every layer
that needs no privilege: the host read-only, a per-namespace fork cap), scored like root's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from bus import BusConfig, connect
from bus import topology as topo
from envs import isolation, runs_code
from tests.helpers.unprivileged import AS_NOBODY, NO_USERNS, ROOT, unprivileged
from tests.test_scorer_process import dlq_reasons, rollout, scored_events


@pytest.fixture(scope="module")
def user():
    u = unprivileged()
    if isinstance(u, str):
        pytest.skip(u)
    yield u
    u.close()


def test_arithmetic_runs_no_code_and_code_environments_do():
    for name in ("arith", "arith-small", "arith-long", "arith-chat", "arith-chat-12"):
        assert not runs_code(name), name
    for name in ("python-tests", "swe-gen", "swe-demo", "no-such-env"):  # unknown: assumed to
        assert runs_code(name), name
    assert not isolation.needed(["arith-small"]) and not isolation.needed(["arith", "arith-chat"])
    assert isolation.needed(["arith", "python-tests"]) and isolation.needed([])  # none named: any


def test_a_process_serving_arithmetic_only_starts_without_the_check():
    assert isolation.startup(False, None, ["arith-small"]) == {}


async def test_a_scorer_for_arithmetic_without_user_namespaces_scores_it_and_parks_code(fresh_server):
    """Not root, no user namespace allowed, [sandbox] envs = ["arith"]: it starts (no check), scores
    arithmetic, and a rollout that would run code (python-tests) is parked with the refusal, not
    run in a sandbox it lacks; nothing is lost (the DLQ keeps it)."""
    fd, conf = tempfile.mkstemp(prefix="asyncrl-test-", suffix=".toml")  # readable by uid 65534
    with os.fdopen(fd, "w") as f:
        f.write(
            '[sandbox]\nenvs = ["arith"]\n[run]\nheartbeat_s = 0.5\n'
            f'[bus]\nservers = ["{fresh_server.url}"]\n'
        )
    os.chmod(conf, 0o644)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/", "ASYNCRL_LOG_JSON": "1"}
    p = subprocess.Popen(
        [sys.executable, "-c", NO_USERNS, AS_NOBODY, conf],
        cwd="/",
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    bus = await connect(BusConfig(servers=[fresh_server.url], name="t"))
    try:
        await bus.provision()
        code = rollout(
            "t2-0", "def f(x):\n    return x", env="python-tests", spec={"entry": "f", "tests": [[[1], 1]]}
        )
        for r in (rollout("t1-0", "#42"), code):
            await bus.publish(topo.rollout_subject(r.env), r)
        scored = await scored_events(bus, 1)
        assert scored["t1-0"].success == 1.0 and "t2-0" not in scored
        reasons = await dlq_reasons(bus, 1)
        assert len(reasons) == 1 and reasons[0].startswith(
            "rollout of python-tests refused: rootless sandbox incomplete (uid 65534): missing layer(s) netns"
        ), reasons
        assert "needs user namespaces" in reasons[0]
    finally:
        await bus.close()
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        os.unlink(conf)


def test_the_refusal_names_each_missing_layer_and_what_provides_it():
    msg = isolation.refusal(["netns", "ro-host", "nproc-ns", "pdeathsig"], uid=1000)
    assert msg.startswith("rootless sandbox incomplete (uid 1000): missing layer(s) netns, ro-host, nproc-ns")
    assert "netns, ro-host: needs user namespaces" in msg and "max_user_namespaces" in msg
    assert "nproc-ns: needs Linux >= 5.14" in msg and "pdeathsig: needs setpriv" in msg
    assert "run it as root" in msg and "allow_weak_sandbox = true" in msg
    root = isolation.refusal(["fresh-uid"], uid=0)
    assert root.startswith("sandbox isolation incomplete (uid 0): missing layer(s) fresh-uid")
    # as root every layer is required; as anyone else fresh-uid (root only) gives way to ro-host, nproc-ns
    assert "fresh-uid" not in isolation.ROOTLESS_LAYERS
    assert set(isolation.ROOTLESS_LAYERS) == set(isolation.LAYERS) - {"fresh-uid"} | {"ro-host", "nproc-ns"}


def test_demo_as_a_user_who_is_not_root_reaches_versions(user):
    """deploy/demo.toml, shortened (a short warm start, no in-run eval), `asyncrl up` with its
    embedded broker as that user: its run directory under a directory of its own."""
    text = (ROOT / "deploy" / "demo.toml").read_text()
    for old, new in (("steps = 1500", "steps = 10"), ("eval_every = 25", "eval_every = 0")):
        assert old in text, old
        text = text.replace(old, new)
    cfg = user.base / "demo.toml"
    cfg.write_text(text)
    os.chown(cfg, user.uid, user.gid)
    run_dir = user.base / "runs" / "demo"
    r = user.run(
        [user.python, "-m", "asyncrl.cli", "up", "--config", str(cfg), "--steps", "3", "--minutes", "6"]
        + ["--run-dir", str(run_dir), "--quiet"],
        timeout=560,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["stopped"].startswith("reached") and summary["versions"] >= 3, summary
    assert summary["restarts"] == {"trainer": 0, "scorer": 0, "rollout_worker": 0}, summary
    assert run_dir.stat().st_uid == user.uid and (run_dir / "checkpoints").stat().st_uid == user.uid
    for name in ("scorer-0", "worker-0", "worker-1"):  # arithmetic: no sandbox asked of them
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert "sandbox check skipped: no environment here runs code" in log, name
        assert "refuses to start" not in log, name


# Run as the user: two episodes of one task in the rootless sandbox, workspaces under its own root.
# One plays the hacks a policy would (write outside its workspace: the user's files, the tools
# the scoring runs, the other episode's workspace) and submits unfixed; the other fixes the bug.
EPISODES = r"""
import json, os, sys
from envs import isolation
from envs.episode import Episode, EpisodeLimits, EpisodeTask
from envs.sandbox import BashLimits
from envs.workspace import LocalBackend

root, outside = sys.argv[1], sys.argv[2]
TESTS = ("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_zero():\n    assert add(0, 0) == 0\n")
task = EpisodeTask("t-add", "test", "train", "Fix calc.py.",
                   {"calc.py": "def add(a, b):\n    return a - b\n", "test_calc.py": TESTS},
                   {"test_calc.py": TESTS}, "mini", ["test_calc.py"], ["test_calc.py::test_add"],
                   ["test_calc.py::test_zero"])
limits = EpisodeLimits(command=BashLimits(wall_s=10.0, cpu_s=5), max_turns=8, score_wall_s=60.0)
bash = lambda c: f"Running it.\n```bash\n{c}\n```"
out = {"check": isolation.require()}
honest, hack = (Episode(task, limits, backend=LocalBackend(root)) for _ in range(2))
honest.reset(); hack.reset()
run = lambda ep, c: ep.workspace.run(c, limits.command)
out["layers"] = run(honest, "true").isolation
out["ids"] = run(honest, "id -u; head -n1 /proc/self/uid_map").stdout.decode().split()
tools = os.path.join(hack.workspace.root, "tools", "run_tests")
before = open(tools).read()
out["escape"] = hack.step(bash(
    f"echo x > {outside}; printf '#!/bin/sh\\necho 2 passed\\n' > {tools}; echo x > ../escape; "
    f"echo 'def add(a, b):\\n    return 0' > {honest.workspace.repo}/calc.py; "
    f"mkdir -p ../score && echo x > ../score/test_calc.py; echo x > {root}/escape")).observation
out["left"] = [p for p in (outside, os.path.join(hack.workspace.root, "escape"), os.path.join(root, "escape"))
               if os.path.exists(p)]
out["tools_intact"] = open(tools).read() == before
out["honest_intact"] = "return a - b" in open(os.path.join(honest.workspace.repo, "calc.py")).read()
hack.step(bash("submit"))
r = hack.score(); out["hack"] = [r.reward, r.resolved]
fix = ("replace calc.py <<'EOF'\n<<<<<<< SEARCH\n    return a - b\n=======\n    return a + b\n"
       ">>>>>>> REPLACE\nEOF")
for action in (fix, "run_tests", "submit"):
    out.setdefault("steps", []).append(honest.step(bash(action)).observation[-300:])
r = honest.score(); out["honest"] = [r.reward, r.resolved]
honest.close(); hack.close()
print(json.dumps(out))
"""


def test_code_episode_in_the_rootless_sandbox_as_that_user(user):
    root, outside = user.base / "episodes", user.base / "outside-the-workspace"
    r = user.run([user.python, "-c", EPISODES, str(root), str(outside)], timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # the user's own check: every rootless layer in place (fresh-uid needs root: not asked)
    assert out["check"] == {k: True for k in isolation.ROOTLESS_LAYERS}
    got = set(out["layers"])
    assert {"netns", "pidns", "mountns", "tmp-masks", "ipcns", "no-caps", "no-userns", "pdeathsig"} <= got
    assert {"ro-host", "nproc-ns"} <= got and "fresh-uid" not in got, got
    # root of its namespace, which is the user's own uid outside it
    assert out["ids"] == ["0", "0", str(user.uid), "1"], out["ids"]
    # every write outside its workspace refused: nothing left, the tools and the other episode intact
    assert out["escape"].count("Read-only file system") >= 5, out["escape"]
    assert out["left"] == [] and out["tools_intact"] and out["honest_intact"], out
    assert not outside.exists()
    # scored as root's sandbox scores: the hack gains nothing (what the unfixed repository scores:
    # its pass-to-pass test only, unresolved), the fix scores 1 (so this test can fail)
    assert out["hack"] == [0.5, False], out
    assert out["honest"] == [1.0, True], out
