"""The container workspace backend (envs/workspace_docker.py): the command lines it builds, the
wrapper that runs inside the container (run here with bash, exactly as `docker exec` would run it),
the tar it copies in; and a whole episode in a real container where `docker info` works."""

from __future__ import annotations

import io
import subprocess
import tarfile

import pytest

from envs import workspace_docker as wd
from envs.episode import EpisodeLimits, EpisodeTask
from envs.sandbox import BashLimits

B = wd.DockerBackend(image="img:1", user="1000:1001", pids=99, memory_mb=512, cpus=0.5, tmp_mb=32)
TESTS = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def task(**kw) -> EpisodeTask:
    return EpisodeTask(
        **{
            **dict(
                task_id="t-add",
                family="test",
                split="train",
                instruction="Fix calc.py.",
                files={"calc.py": "def add(a, b):\n    return a - b\n", "tests/test_calc.py": TESTS},
                hidden_tests={"tests/test_calc.py": TESTS},
                runner="mini",
                test_paths=["tests/test_calc.py"],
                fail_to_pass=["tests/test_calc.py::test_add"],
                pass_to_pass=[],
            ),
            **kw,
        }
    )


def test_create_exec_copy_and_rm_command_lines():
    argv = wd.create_argv(B, "ep1", "img:1")
    assert argv[:4] == ["docker", "create", "--name", "ep1"] and argv[-3:] == ["sleep", "img:1", "infinity"]
    opts = dict(zip(argv[4:-2:2], argv[5:-2:2]))
    assert opts["--network"] == "none" and opts["--pids-limit"] == "99" and opts["--memory"] == "512m"
    assert opts["--memory-swap"] == "512m" and opts["--cpus"] == "0.5" and opts["--cap-drop"] == "ALL"
    assert opts["--tmpfs"] == "/tmp:rw,nosuid,nodev,size=32m" and opts["--entrypoint"] == "sleep"
    assert wd.copy_in_argv(B, "ep1") == ["docker", "cp", "-a", "-", "ep1:/"]
    assert wd.rm_argv(B, "ep1") == ["docker", "rm", "-f", "-v", "ep1"]
    assert wd.commit_argv(B, "ep1", "x:y") == ["docker", "commit", "ep1", "x:y"]
    lim = BashLimits(wall_s=3.0, cpu_s=4, memory_mb=256, file_mb=2, open_files=64, keep_bytes=100)
    ex = wd.exec_argv(B, "ep1", "/workspace", "echo hi", lim)
    assert ex[:6] == ["docker", "exec", "-u", "1000:1001", "-w", "/workspace"]
    assert f"PATH={wd.TOOLS}:/usr/local/bin:/usr/bin:/bin" in ex and ex.index("ep1") < ex.index("bash")
    assert ex[-4:] == ["asyncrl-exec", "100", "3.0s", "echo hi"]  # the command is one argv item
    assert "ulimit -c 0 -t 4 -v 262144 -f 2048 -n 64" in ex[-5]
    assert wd.exec_argv(B, "ep1", "/w", "x", lim, user="0")[3] == "0"


def wrapper(command: str, lim: BashLimits) -> subprocess.CompletedProcess:
    """What `docker exec` runs in the container, run here by bash."""
    argv = wd.exec_argv(B, "ep1", "/", command, lim)
    return subprocess.run(argv[argv.index("bash") :], capture_output=True, timeout=60, cwd="/tmp")


def test_the_wrapper_caps_output_kills_at_the_wall_limit_and_keeps_exit_codes():
    lim = BashLimits(wall_s=1.0, cpu_s=5, file_mb=1, keep_bytes=50)
    r = wrapper("echo out; echo err >&2; exit 3", lim)
    assert r.returncode == 3 and r.stdout == b"out\nerr\n"
    assert wd.exec_reason(r.returncode, False, 0.1, lim) == "exit code 3"
    r = wrapper("seq 1 100000", lim)  # long output: head and tail only
    assert r.returncode == 0 and r.stdout.startswith(b"1\n2\n") and r.stdout.endswith(b"99999\n100000\n")
    assert b"bytes omitted" in r.stdout and len(r.stdout) < 200
    r = wrapper("yes", lim)  # endless output: the file size limit stops it
    assert (
        wd.exec_reason(r.returncode, False, 0.5, lim) == "output limit (1 MB) exceeded"
        and len(r.stdout) < 200
    )
    r = wrapper("sleep 30 & sleep 30", lim)  # the whole process group dies at the wall limit
    assert r.returncode == 137 and wd.exec_reason(137, False, 1.2, lim) == "wall timeout after 1.0s"
    assert wd.exec_reason(137, False, 0.2, lim) == "killed (out of memory)"
    assert wd.exec_reason(0, True, 99.0, lim) == "wall timeout after 1.0s"
    assert wd.exec_reason(0, False, 0.1, lim) == "ok"


def test_tar_carries_paths_modes_and_owners_and_refuses_escapes():
    data = wd.tar_of(
        {
            "/workspace": (None, 0o755, 1000, 1001),
            "/workspace/pkg/a.py": (b"x = 1\n", 0o644, 1000, 1001),
            f"{wd.TOOLS}/view": (b"#!/bin/sh\n", 0o755, 0, 0),
        }
    )
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        m = {i.name: i for i in tar.getmembers()}
        assert tar.extractfile("workspace/pkg/a.py").read() == b"x = 1\n"
    assert (m["workspace/pkg/a.py"].uid, m["workspace/pkg/a.py"].gid, m["workspace/pkg/a.py"].mode) == (
        1000,
        1001,
        0o644,
    )
    assert m["workspace/pkg"].isdir() and m["workspace/pkg"].uid == 1000
    assert "opt" not in m  # a top-level directory of the image keeps its owner
    assert m["workspace"].isdir() and m["workspace"].uid == 1000
    assert m["opt/asyncrl-tools/view"].mode == 0o755 and m["opt/asyncrl-tools/view"].uid == 0
    with pytest.raises(ValueError, match="leaves the container root"):
        wd.tar_of({"/workspace/../etc/passwd": (b"", 0o644, 0, 0)})


def test_a_task_with_a_base_dir_is_refused_clearly():
    ws = wd.DockerBackend(docker="/nonexistent/docker").create(task(base_dir="/srv/repo"), EpisodeLimits())
    assert "meta['image']" in ws.error
    ws.close()  # nothing was created: nothing to remove
    ws = wd.DockerBackend(docker="/nonexistent/docker").create(task(), EpisodeLimits())
    assert ws.error.startswith("workspace setup failed") and "create" in ws.error
    ws.close()


@pytest.mark.skipif(not wd.available(), reason="no working docker daemon here")
def test_an_episode_runs_in_a_container():
    """The oracle episode of a generated task in a python image: same observations and score as local."""
    from envs.episode import Episode
    from envs.oracle import run_oracle

    b = wd.DockerBackend()
    _, turns, res = run_oracle(task(), EpisodeLimits(command=BashLimits(wall_s=20.0)), b)
    assert res.reward == 1.0 and res.termination == "submitted", (res, turns)
    ep = Episode(task(), EpisodeLimits(command=BashLimits(wall_s=2.0)), b)
    try:
        ep.reset()
        r = ep.step(
            "```bash\ncat /etc/hostname; "
            "python -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), 2)'\n```"
        )
        assert "exit code" in r.observation or "Error" in r.observation
        r = ep.step("```bash\nsleep 60\n```")
        assert "wall timeout" in r.observation
        ep.step("```bash\nsubmit\n```")
        assert ep.score().reward == 0.0
    finally:
        ep.close()
    out = subprocess.run(
        ["docker", "ps", "-a", "--filter", "label=asyncrl.episode=1", "-q"], capture_output=True
    )
    assert out.stdout.strip() == b""  # every container removed


def test_the_worker_config_selects_the_backend():
    from rollout_worker.config import WorkerConfig
    from rollout_worker.episodes import workspace_backend

    def backend(**episodes):  # the [worker.episodes] section, handed whole to workspace_backend
        return workspace_backend(WorkerConfig(worker_id="w", episodes=episodes).episodes)

    assert backend() is None  # local: the default
    b = backend(workspace="docker", docker_image="swe:1")
    assert isinstance(b, wd.DockerBackend) and b.image == "swe:1"
    assert backend(workspace="docker").image == wd.DockerBackend().image
    with pytest.raises(ValueError, match="workspace must be 'local' or 'docker'"):
        WorkerConfig(worker_id="w", episodes={"workspace": "podman"})
