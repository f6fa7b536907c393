"""The container workspace backend: an episode's commands in a Docker container, via the `docker` CLI.

For SWE-bench-style instances, whose repositories need their own image and dependencies, on
machines with Docker. Same interface as envs/workspace.py's LocalBackend (the episode, the action
format, the helpers and the scoring are unchanged; only where commands run differs):

    create            docker create --network none --pids-limit --memory --cpus --tmpfs /tmp
                        IMAGE sleep infinity
                      docker cp -a - NAME:/      (a tar: the task's files in WORKDIR, owned by the
                                                  episode's user; the helpers in TOOLS, root-owned)
                      docker start NAME
    run               docker exec -u USER -w WORKDIR -e PATH=TOOLS:... NAME bash -c 'ulimit ...;
                      timeout -s KILL WALL bash -c COMMAND > capped file; its head and tail'
                      (as the local sandbox; the docker client has a wall limit of its own)
    over_limit        docker exec NAME du / find over WORKDIR
    run_hidden_tests  docker commit NAME -> a second container from that image (nothing the episode
                      left running comes along), the hidden tests copied in, the task's test command
                      in report mode with a nonce, parsed with parse_report; both removed after
    close             docker rm -f NAME

The image is the task's (`meta["image"]`, `meta["workdir"]`) or the backend's default; the task's
files are written over WORKDIR (the image may already hold the repository). Isolation is Docker's:
no network, a pid limit (fork bombs), memory and CPU caps, a size-capped tmpfs /tmp, rlimits per
command, an unprivileged user; the hidden tests never enter the episode's container.

The command lines are built by pure functions (`*_argv`), so they are tested without Docker; the
episode test with a real container runs only where `docker info` works.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import shlex
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass

from .sandbox import BashLimits, SandboxResult, head_tail
from .test_report import parse_report
from .workspace_tools import REPORT_KEY, test_command, tool_files

TOOLS = "/opt/asyncrl-tools"


@dataclass(frozen=True)
class DockerBackend:
    """Workspaces as containers; picklable (settings only: every call is a `docker` process)."""

    image: str = "python:3.12-slim"
    workdir: str = "/workspace"
    python: str = "/usr/local/bin/python3"  # the image's python (the helpers' interpreter)
    user: str = "1000:1000"  # the episode's commands run as this uid:gid
    docker: str = "docker"
    memory_mb: int = 2048
    cpus: float = 1.0
    pids: int = 256  # processes + threads in the container (fork-bomb cap)
    tmp_mb: int = 64
    client_slack_s: float = 30.0  # the docker client's wall limit beyond the command's

    def create(self, task, limits) -> DockerWorkspace:
        return DockerWorkspace(task, self)


def available(docker: str = "docker") -> bool:
    """Whether a docker daemon answers here."""
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# -- the command lines -----------------------------------------------------------------------------
def create_argv(b: DockerBackend, name: str, image: str) -> list[str]:
    return [
        b.docker,
        "create",
        "--name",
        name,
        "--network",
        "none",
        "--pids-limit",
        str(b.pids),
        "--memory",
        f"{b.memory_mb}m",
        "--memory-swap",
        f"{b.memory_mb}m",
        "--cpus",
        str(b.cpus),
        "--tmpfs",
        f"/tmp:rw,nosuid,nodev,size={b.tmp_mb}m",
        "--security-opt",
        "no-new-privileges",
        "--cap-drop",
        "ALL",
        "--label",
        "asyncrl.episode=1",
        "--entrypoint",
        "sleep",
        image,
        "infinity",
    ]


def copy_in_argv(b: DockerBackend, name: str) -> list[str]:
    """A tar stream on stdin, extracted at / with the ownership it carries (-a)."""
    return [b.docker, "cp", "-a", "-", f"{name}:/"]


# Runs in the container as the episode's user: rlimits, then the command under `timeout` (its own
# process group, all killed at the wall limit) with its output in a file capped by `ulimit -f`,
# of which only the head and tail cross to the client (an endless output never leaves the container).
EXEC_WRAPPER = r"""
keep=$1 wall=$2 cmd=$3 out=$(mktemp /tmp/.asyncrl-out.XXXXXX) || exit 197
timeout -s KILL "$wall" bash -c "$cmd" </dev/null >"$out" 2>&1
rc=$?
size=$(stat -c %s "$out")
if [ "$size" -le $((2 * keep)) ]; then cat "$out"; else
  head -c "$keep" "$out"; printf '\n[... %s bytes omitted ...]\n' $((size - 2 * keep)); tail -c "$keep" "$out"; fi
rm -f "$out"
exit $rc
"""  # noqa: E501  (the lines of a script run in the sandbox, kept as written)


def exec_argv(
    b: DockerBackend, name: str, workdir: str, command: str, limits: BashLimits, user: str | None = None
) -> list[str]:
    """bash -c COMMAND in the container under rlimits and a wall limit (see EXEC_WRAPPER)."""
    ulimits = (
        f"ulimit -c 0 -t {limits.cpu_s} -v {limits.memory_mb << 10} -f {limits.file_mb << 10} "
        f"-n {limits.open_files} || exit 197"
    )
    return [
        b.docker,
        "exec",
        "-u",
        user or b.user,
        "-w",
        workdir,
        "-e",
        f"PATH={TOOLS}:/usr/local/bin:/usr/bin:/bin",
        "-e",
        "HOME=/tmp",
        "-e",
        "TMPDIR=/tmp",
        "-e",
        "LANG=C.UTF-8",
        "-e",
        "PYTHONDONTWRITEBYTECODE=1",
        "-e",
        "PYTHONUNBUFFERED=1",
        name,
        "bash",
        "-c",
        ulimits + EXEC_WRAPPER,
        "asyncrl-exec",
        str(limits.keep_bytes),
        f"{limits.wall_s}s",
        command,
    ]


def size_argv(b: DockerBackend, name: str, workdir: str) -> list[str]:
    q = shlex.quote(workdir)
    return [b.docker, "exec", "-u", "0", name, "sh", "-c", f"du -sk {q} | cut -f1; find {q} | wc -l"]


def commit_argv(b: DockerBackend, name: str, image: str) -> list[str]:
    return [b.docker, "commit", name, image]


def rm_argv(b: DockerBackend, name: str) -> list[str]:
    return [b.docker, "rm", "-f", "-v", name]


def rmi_argv(b: DockerBackend, image: str) -> list[str]:
    return [b.docker, "rmi", "-f", image]


def start_argv(b: DockerBackend, name: str) -> list[str]:
    return [b.docker, "start", name]


def tar_of(entries: dict[str, tuple[bytes | None, int, int, int]]) -> bytes:
    """A tar of {absolute path: (content or None for a directory, mode, uid, gid)}; parent directories
    below the top level are owned like their file (a top-level one is the image's unless listed)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for path, (data, mode, uid, gid) in sorted(entries.items()):
            rel = path.lstrip("/")
            if ".." in rel.split("/") or not rel:
                raise ValueError(f"path {path!r} leaves the container root")
            parts = rel.split("/")[:-1]
            for k in range(1, len(parts) + 1):
                d = "/".join(parts[:k])
                if d not in dirs and k > 1:  # never re-own a top-level directory of the image
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, uid, gid
                    tar.addfile(info)
            info = tarfile.TarInfo(rel)
            info.mode, info.uid, info.gid, info.mtime = mode, uid, gid, int(time.time())
            if data is None:
                if rel not in dirs:
                    dirs.add(rel)
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                continue
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _ids(user: str) -> tuple[int, int]:
    u, _, g = user.partition(":")
    return int(u), int(g or u)


# -- the workspace ---------------------------------------------------------------------------------
class DockerWorkspace:
    def __init__(self, task, backend: DockerBackend):
        self.b, self.error, self.created = backend, "", False
        self.name = f"asyncrl-ep-{secrets.token_hex(6)}"
        meta = task.meta or {}
        self.image, self.workdir = meta.get("image") or backend.image, meta.get("workdir") or backend.workdir
        if task.base_dir:
            self.error = (
                "the docker backend takes the repository from the image (meta['image']), not base_dir"
            )
            return
        uid, gid = _ids(backend.user)
        entries = {self.workdir: (None, 0o755, uid, gid)}  # the episode's user may add files
        entries.update(
            {f"{self.workdir}/{rel}": (text.encode(), 0o644, uid, gid) for rel, text in task.files.items()}
        )
        entries.update(
            {
                f"{TOOLS}/{n}": (text.encode(), mode, 0, 0)
                for n, (text, mode) in tool_files(backend.python, task.runner, task.test_paths, TOOLS).items()
            }
        )
        try:
            self._docker(create_argv(backend, self.name, self.image), timeout=300)
            self.created = True
            self._docker(copy_in_argv(backend, self.name), stdin=tar_of(entries))
            self._docker(start_argv(backend, self.name))
        except (RuntimeError, ValueError) as e:
            self.error = f"workspace setup failed: {e}"

    def _docker(self, argv: list[str], stdin: bytes | None = None, timeout: float = 120.0) -> bytes:
        try:
            p = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"{argv[1]}: {e}") from None
        if p.returncode != 0:
            raise RuntimeError(
                f"{argv[1]} exited {p.returncode}: {p.stderr.decode('utf-8', 'replace').strip()[-300:]}"
            )
        return p.stdout

    def run(
        self,
        command: str,
        limits: BashLimits,
        name: str | None = None,
        user: str | None = None,
        workdir: str | None = None,
    ) -> SandboxResult:
        t0 = time.perf_counter()
        argv = exec_argv(self.b, name or self.name, workdir or self.workdir, command, limits, user)
        with tempfile.NamedTemporaryFile(prefix="asyncrl-docker-") as out:
            try:
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
                try:
                    rc = p.wait(timeout=limits.wall_s + self.b.client_slack_s)
                    client_timeout = False
                except subprocess.TimeoutExpired:
                    p.kill()
                    rc, client_timeout = p.wait(), True
            except OSError as e:
                return SandboxResult(
                    f"sandbox error: {e}", -1, wall_s=time.perf_counter() - t0, isolation=["docker"]
                )
            output = head_tail(out.name, os.path.getsize(out.name), limits.keep_bytes)
        wall = time.perf_counter() - t0
        return SandboxResult(
            exec_reason(rc, client_timeout, wall, limits),
            rc,
            output,
            b"",
            wall,
            ["docker", "netns", "pids-limit", "rlimits", "user"],
        )

    def over_limit(self, max_mb: int, max_files: int) -> str:
        try:
            kb, n = (int(x) for x in self._docker(size_argv(self.b, self.name, self.workdir)).split()[:2])
        except (RuntimeError, ValueError) as e:
            return f"workspace size unknown: {e}"
        if n > max_files:
            return f"workspace has more than {max_files} files"
        return f"workspace is over {max_mb} MB" if kb > max_mb << 10 else ""

    def run_hidden_tests(self, task, limits) -> tuple[dict[str, str], str]:
        """The task's tests in a fresh container from a commit of this one, hidden tests restored."""
        image, score = f"asyncrl-score:{self.name}", f"{self.name}-score"
        uid, gid = _ids(self.b.user)
        try:
            self._docker(commit_argv(self.b, self.name, image), timeout=300)
            self._docker(create_argv(self.b, score, image), timeout=300)
            nonce = secrets.token_hex(16)  # in a key file the runner deletes, never on its command line
            key = json.dumps({"nonce": nonce, "tests": {}}).encode()
            self._docker(
                copy_in_argv(self.b, score),
                stdin=tar_of(
                    {
                        **{
                            f"{self.workdir}/{rel}": (text.encode(), 0o644, uid, gid)
                            for rel, text in task.hidden_tests.items()
                        },
                        f"{self.workdir}/{REPORT_KEY}": (key, 0o600, uid, gid),
                    }
                ),
            )
            self._docker(start_argv(self.b, score))
            lim = BashLimits(
                **{
                    **limits.command.__dict__,
                    "wall_s": limits.score_wall_s,
                    "cpu_s": int(limits.score_wall_s) + 1,
                }
            )
            res = self.run(test_command(task.runner, task.test_paths, TOOLS, report=True), lim, name=score)
            return parse_report(res.stdout.decode("utf-8", "replace"), nonce, task.runner), (
                "" if res.ok or res.reason.startswith("exit code") else f"tests: {res.reason}"
            )
        except (RuntimeError, ValueError) as e:
            return {}, f"scoring container failed: {e}"
        finally:
            for argv in (rm_argv(self.b, score), rmi_argv(self.b, image)):
                subprocess.run(argv, capture_output=True, timeout=120)

    def close(self) -> None:
        if self.created:
            subprocess.run(rm_argv(self.b, self.name), capture_output=True, timeout=120)
            self.created = False


def exec_reason(rc: int, client_timeout: bool, wall_s: float, limits: BashLimits) -> str:
    """The local sandbox's reasons, from `timeout`'s and bash's exit codes inside the container."""
    if client_timeout or (rc == 137 and wall_s >= limits.wall_s):
        return f"wall timeout after {limits.wall_s}s"  # timeout -s KILL: the command's process group
    if rc == 137:
        return "killed (out of memory)"  # the container's memory cgroup
    if rc == 197:
        return "sandbox error: ulimit failed in the container"
    if rc == 128 + 24:
        return f"cpu time limit ({limits.cpu_s}s) exceeded"
    if rc == 128 + 25:
        return f"output limit ({limits.file_mb} MB) exceeded"
    if rc == 125:
        return "sandbox error: docker exec failed"
    return "ok" if rc == 0 else f"exit code {rc}"
