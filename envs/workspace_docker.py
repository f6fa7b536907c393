"""The container workspace backend: an episode's commands in a Docker container, via the `docker` CLI.

For SWE-bench-style instances, whose repositories need their own image and dependencies, on
machines with Docker. Same interface as envs/workspace.py's LocalBackend, and the same scoring
(envs/scoring_run.py on a pristine scoring copy); only where commands run differs:

    create            docker create --network none --pids-limit --memory --cpus --tmpfs /tmp ...
                        [--mount type=bind,source=ENV/site,target=TOOLS/env,readonly] IMAGE sleep infinity
                      docker start NAME
                      docker exec -u 0 NAME: the workdir emptied (unless the image holds the task's
                        repository) and the image's python probed (its version, against the
                        repository environment's; whether it has pytest)
                      docker cp -a - NAME:/  (a tar: the repository snapshot (base_dir) and the task's
                        files in WORKDIR, owned by the episode's user; the tool commands in TOOLS, and a
                        copy of pytest in TOOLS/site when the image's python has none, root-owned)
    run               docker exec -u USER -w WORKDIR -e PATH=TOOLS:... [-e PYTHONPATH=...] NAME bash -c
                      'ulimit ...; timeout -s KILL WALL bash -c COMMAND > capped file; its head and tail'
                      (as the local sandbox; the docker client has a wall limit of its own)
    over_limit        docker exec NAME du / find over WORKDIR
    run_hidden_tests  docker kill NAME (whatever the episode left running ends here), then
                      docker cp NAME:WORKDIR - (the agent's tree, here) -> envs/scoring_run.score, as
                      the local backend: the scoring copy (the task's pristine tree plus the agent's
                      changes to source files, envs/scoring_copy.py), keys and honeypots, run in a
                      fresh container from IMAGE (same mounts, workdir emptied, the copy and the
                      tools copied in), whose test-infrastructure files come back for the on-disk
                      tamper checks; removed after
    close             docker rm -f -v NAME

The image is the task's (`meta["image"]`, `meta["workdir"]`) or the backend's default. The task's
pristine tree is its `base_dir` (an imported repository snapshot) when it has one, else the image's
workdir when the task names its image (an image-only instance), else nothing; its `files` go over
it, as LocalWorkspace writes them. The scoring container starts from the image, not from a commit
of the episode's container: the scoring copy is complete, so nothing of the episode's container but
the agent's change to source files reaches scoring. A repository environment (`env_dir`,
envs/repo_env.py) is bind-mounted read-only at TOOLS/env in both containers and put on PYTHONPATH,
as the local sandbox does with its mounted copy; it must have been built for the image's python
version (the daemon must see the task set's path: a local daemon).

Isolation is Docker's: no network, a pid limit (fork bombs), memory and CPU caps, a size-capped
tmpfs /tmp, rlimits per command, an unprivileged user; the hidden tests never enter the episode's
container.

The command lines are built by pure functions (`*_argv`), so they are tested without Docker, and a
whole episode runs against a stand-in `docker` executable (tests/test_envs_workspace_docker.py);
the episode test with a real container runs only where `docker info` works.
"""

from __future__ import annotations

import dataclasses
import io
import os
import secrets
import shlex
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass

from . import repo_env, scoring_copy, scoring_run
from .safe_path import clear_for_write
from .sandbox import BashLimits, SandboxResult, head_tail
from .test_report import ScoreInfo
from .workspace import default_root, private_root, pytest_site
from .workspace_tools import tool_files

TOOLS = "/opt/asyncrl-tools"


@dataclass(frozen=True)
class DockerBackend:
    """Workspaces as containers; picklable (settings only: every call is a `docker` process)."""

    image: str = "python:3.12-slim"
    workdir: str = "/workspace"
    python: str = "/usr/local/bin/python3"  # the image's python (the tool commands' interpreter)
    user: str = "1000:1000"  # the episode's commands run as this uid:gid
    docker: str = "docker"
    memory_mb: int = 2048
    cpus: float = 1.0
    pids: int = 256  # processes + threads in the container (fork-bomb cap)
    tmp_mb: int = 64
    client_slack_s: float = 30.0  # the docker client's wall limit beyond the command's
    tools: str = TOOLS  # the tool commands' directory in the container (root-owned, first on PATH)

    def create(self, task, limits) -> DockerWorkspace:
        return DockerWorkspace(task, self)


def available(docker: str = "docker") -> bool:
    """Whether a docker daemon answers here."""
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def env_target(b: DockerBackend) -> str:
    """Where a repository environment's site dir is mounted (read-only) in the containers."""
    return f"{b.tools}/env"


def site_target(b: DockerBackend) -> str:
    """Where the copy of pytest goes when the image's python has none."""
    return f"{b.tools}/site"


# -- the command lines -----------------------------------------------------------------------------
def create_argv(
    b: DockerBackend, name: str, image: str, mounts: list[tuple[str, str]] | tuple = ()
) -> list[str]:
    """`mounts`: (directory here, path in the container), bound read-only."""
    binds = []
    for src, dst in mounts:
        if any(c in src + dst for c in ",\n") or not os.path.isabs(src):
            raise ValueError(f"cannot mount {src!r} at {dst!r}: an absolute path without ',' is needed")
        binds += ["--mount", f"type=bind,source={src},target={dst},readonly"]
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
        *binds,
        "--entrypoint",
        "sleep",
        image,
        "infinity",
    ]


def copy_in_argv(b: DockerBackend, name: str) -> list[str]:
    """A tar stream on stdin, extracted at / with the ownership it carries (-a)."""
    return [b.docker, "cp", "-a", "-", f"{name}:/"]


def copy_out_argv(b: DockerBackend, name: str, path: str) -> list[str]:
    """A tar of `path` (its entries under its base name) on stdout; a stopped container's too."""
    return [b.docker, "cp", f"{name}:{path}", "-"]


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
    b: DockerBackend,
    name: str,
    workdir: str,
    command: str,
    limits: BashLimits,
    user: str | None = None,
    pythonpath: list[str] | tuple = (),
) -> list[str]:
    """bash -c COMMAND in the container under rlimits and a wall limit (see EXEC_WRAPPER);
    `pythonpath`: the site dirs on the python path (the pytest copy, the repository environment)."""
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
        f"PATH={b.tools}:/usr/local/bin:/usr/bin:/bin",
        *(["-e", "PYTHONPATH=" + ":".join(pythonpath)] if pythonpath else []),
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


PROBE = (
    "import sys, importlib.util as u; "
    "print('asyncrl-probe', '%d.%d' % sys.version_info[:2], int(u.find_spec('pytest') is not None))"
)


def setup_command(workdir: str, clear: bool, python: str | None) -> str:
    """Run as root in a new container before anything is copied in: the workdir emptied (`clear`:
    the image's copy of the repository, if any, is not the task's), then `python` probed (PROBE)."""
    parts = [f"rm -rf -- {shlex.quote(workdir)} || exit 196"] if clear else []
    if python:
        parts.append(f"{shlex.quote(python)} -c {shlex.quote(PROBE)}")
    return "\n".join(parts)


def parse_probe(out: str) -> tuple[str, bool] | None:
    """(python version "3.X", has pytest) from PROBE's line, or None."""
    for line in out.splitlines():
        f = line.split()
        if len(f) == 3 and f[0] == "asyncrl-probe" and f[2] in ("0", "1"):
            return f[1], f[2] == "1"
    return None


def size_argv(b: DockerBackend, name: str, workdir: str) -> list[str]:
    q = shlex.quote(workdir)
    return [b.docker, "exec", "-u", "0", name, "sh", "-c", f"du -sk {q} | cut -f1; find {q} | wc -l"]


def kill_argv(b: DockerBackend, name: str) -> list[str]:
    return [b.docker, "kill", name]


def rm_argv(b: DockerBackend, name: str) -> list[str]:
    return [b.docker, "rm", "-f", "-v", name]


def start_argv(b: DockerBackend, name: str) -> list[str]:
    return [b.docker, "start", name]


# -- tars in and out -------------------------------------------------------------------------------
class Link(str):
    """An entry of `write_tar` that is a symlink to this target."""


def write_tar(
    f,
    entries: dict[str, tuple[bytes | Link | None, int, int, int]],
    trees: list[tuple[str, str, int, int, bool]] | tuple = (),
) -> None:
    """Write to `f` a tar of `trees` [(directory here, absolute path, uid, gid, read_only)], then
    `entries` {absolute path: (content, or a Link, or None for a directory; mode, uid, gid)} over
    them. A tree keeps its symlinks as links and skips anything but directories, regular files and
    links; its files keep their modes (u+rw added) or, read_only, become 0644 / 0755 (executable).
    Parent directories below the top level are owned like their entry (a top-level one is the
    image's unless listed)."""
    with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()

        def add(path: str, data, mode: int, uid: int, gid: int, src: str | None = None) -> None:
            rel = path.lstrip("/")
            if ".." in rel.split("/") or not rel:
                raise ValueError(f"path {path!r} leaves the container root")
            parts = rel.split("/")[:-1]
            for k in range(2, len(parts) + 1):  # never re-own a top-level directory of the image
                d = "/".join(parts[:k])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, uid, gid
                    tar.addfile(info)
            info = tarfile.TarInfo(rel)
            info.mode, info.uid, info.gid, info.mtime = mode, uid, gid, int(time.time())
            if data is None and src is None:
                if rel not in dirs:
                    dirs.add(rel)
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
            elif isinstance(data, Link):
                info.type, info.linkname = tarfile.SYMTYPE, str(data)
                tar.addfile(info)
            elif src is not None:
                info.size = os.path.getsize(src)
                with open(src, "rb") as fh:
                    tar.addfile(info, fh)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

        for src, target, uid, gid, read_only in trees:
            add(target, None, 0o755, uid, gid)
            for d, dnames, fnames in os.walk(src):
                dnames.sort()
                for n in sorted(dnames + fnames):
                    p = os.path.join(d, n)
                    dst = f"{target}/{os.path.relpath(p, src).replace(os.sep, '/')}"
                    st = os.lstat(p)
                    if stat.S_ISLNK(st.st_mode):
                        add(dst, Link(os.readlink(p)), 0o777, uid, gid)
                    elif stat.S_ISDIR(st.st_mode):
                        add(dst, None, 0o755, uid, gid)
                    elif stat.S_ISREG(st.st_mode):
                        mode = stat.S_IMODE(st.st_mode) | 0o600
                        if read_only:
                            mode = 0o755 if st.st_mode & 0o111 else 0o644
                        add(dst, None, mode, uid, gid, src=p)
        for path, (data, mode, uid, gid) in sorted(entries.items()):
            add(path, data, mode, uid, gid)


def tar_of(entries: dict, trees: list | tuple = ()) -> bytes:
    """write_tar's tar, in memory."""
    buf = io.BytesIO()
    write_tar(buf, entries, trees)
    return buf.getvalue()


class TreeTooBig(ValueError):
    """A tree copied out of a container is over the limits given."""


def untar_into(f, dest: str, keep=None, max_bytes: int | None = None, max_files: int | None = None) -> None:
    """Extract the tar stream `f` of `docker cp NAME:DIR -` (entries under DIR's base name) into
    `dest`: directories, regular files and symlinks (as links; never followed: every parent is a
    real directory made here, envs/safe_path.py); a hard link as a copy of its file; anything else
    skipped. `keep(rel)`: only those files (and their directories). TreeTooBig past `max_files`
    entries or `max_bytes` of file content; ValueError for a path outside `dest`."""
    os.makedirs(dest, exist_ok=True)
    n = size = 0

    def rel_of(name: str) -> str:
        if name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"tar entry {name!r} leaves the tree")
        return "/".join(p for p in name.split("/")[1:] if p not in ("", "."))

    with tarfile.open(fileobj=f, mode="r|") as tar:
        for m in tar:
            rel = rel_of(m.name)
            if not rel or (keep is not None and (m.isdir() or not keep(rel))):
                continue
            n += 1
            if max_files is not None and n > max_files:
                raise TreeTooBig(f"more than {max_files} files")
            if m.isdir():
                path = os.path.join(dest, rel)
                if os.path.islink(path) or not os.path.isdir(path):
                    os.mkdir(clear_for_write(dest, rel, "path", "the tree"))
            elif m.issym():
                os.symlink(m.linkname, clear_for_write(dest, rel, "path", "the tree"))
            elif m.isfile() or m.islnk():
                src = None
                if m.islnk():
                    src = os.path.join(dest, rel_of(m.linkname))
                    if os.path.islink(src) or not os.path.isfile(src):
                        continue
                size += os.path.getsize(src) if src else m.size
                if max_bytes is not None and size > max_bytes:
                    raise TreeTooBig(f"over {max_bytes >> 20} MB")
                path = clear_for_write(dest, rel, "path", "the tree")
                if src:
                    shutil.copyfile(src, path)
                else:
                    with open(path, "wb") as out:
                        shutil.copyfileobj(tar.extractfile(m), out)


def _quiet(argv: list[str]) -> None:
    """A docker command whose outcome changes nothing (removals, the kill before scoring)."""
    try:
        subprocess.run(argv, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        pass


def _ids(user: str) -> tuple[int, int]:
    u, _, g = user.partition(":")
    return int(u), int(g or u)


# -- the workspace ---------------------------------------------------------------------------------
class DockerWorkspace:
    def __init__(self, task, backend: DockerBackend):
        self.b, self.error, self.created, self.stopped = backend, "", False, False
        self.score_info = ScoreInfo()  # what the last scoring run found (Episode.score reads it)
        self.name = f"asyncrl-ep-{secrets.token_hex(6)}"
        meta = task.meta or {}
        self.image, self.workdir = meta.get("image") or backend.image, meta.get("workdir") or backend.workdir
        # the task's repository is the image's own: it names its image and has no snapshot here
        self.from_image = bool(meta.get("image")) and not task.base_dir
        self.uid, self.gid = _ids(backend.user)
        self.mounts: list[tuple[str, str]] = []
        self.pythonpath: list[str] = []  # as the local sandbox's: the pytest copy, the environment
        self.site = ""  # the copy of pytest here, when the image's python has none
        self.tools: dict = {}  # the tool commands' tar entries (root-owned), for both containers
        try:
            made = tool_files(backend.python, task.runner, task.test_paths, backend.tools)
            self.tools = {f"{backend.tools}/{n}": (t.encode(), m, 0, 0) for n, (t, m) in made.items()}
            env = None
            if task.env_dir:
                env = repo_env.read_manifest(task.env_dir)
                site = os.path.join(os.path.abspath(task.env_dir), repo_env.SITE)
                self.mounts.append((site, env_target(backend)))
            self._docker(create_argv(backend, self.name, self.image, self.mounts), timeout=300)
            self.created = True
            self._docker(start_argv(backend, self.name))
            probe = env is not None or task.runner == "pytest"
            got = self._setup_run(self.name, clear=not self.from_image, probe=probe)
            if env is not None and env.get("python") != got[0]:
                raise repo_env.EnvError(
                    f"environment {os.path.basename(task.env_dir)} was built for python "
                    f"{env.get('python')}, the image's python ({backend.python}) is {got[0]}: "
                    "build it again with that python"
                )
            if task.runner == "pytest" and not got[1]:
                self.site = pytest_site(private_root(default_root()))
                self.pythonpath.append(site_target(backend))
            if env is not None:
                self.pythonpath.append(env_target(backend))
            self._copy_in(self.name, task.base_dir, task.files)
        except (RuntimeError, ValueError, OSError, repo_env.EnvError) as e:
            self.error = f"workspace setup failed: {e}"

    def _docker(self, argv: list[str], stdin=None, timeout: float = 120.0) -> bytes:
        """Run a docker command; `stdin`: bytes, or a file to read. RuntimeError unless it exits 0."""
        try:
            if stdin is None or isinstance(stdin, bytes):
                p = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)
            else:
                p = subprocess.run(argv, stdin=stdin, capture_output=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"{argv[1]}: {e}") from None
        if p.returncode != 0:
            raise RuntimeError(
                f"{argv[1]} exited {p.returncode}: {p.stderr.decode('utf-8', 'replace').strip()[-300:]}"
            )
        return p.stdout

    def _setup_run(self, name: str, clear: bool, probe: bool) -> tuple[str, bool]:
        """setup_command as root in container `name`; (python version, has pytest) when probed."""
        cmd = setup_command(self.workdir, clear, self.b.python if probe else None)
        if not cmd:
            return "", True
        pp = [env_target(self.b)] if self.mounts else []
        lim = BashLimits(wall_s=120.0, cpu_s=120)
        res = self.run(cmd, lim, name=name, user="0", workdir="/", pythonpath=pp)
        out = res.stdout.decode("utf-8", "replace")
        if not res.ok:
            raise RuntimeError(f"container setup: {res.reason}: {out.strip()[-300:]}")
        got = parse_probe(out) if probe else ("", True)
        if got is None:
            raise RuntimeError(f"the image's python {self.b.python} did not run: {out.strip()[-300:]}")
        return got

    def _copy_in(self, name: str, tree: str | None, files: dict[str, str]) -> None:
        """The workdir (owned by the episode's user, who may add files): `tree` then `files` over it;
        the tool commands and the pytest copy, root-owned."""
        u, g = self.uid, self.gid
        entries = {self.workdir: (None, 0o755, u, g)}
        entries.update({f"{self.workdir}/{rel}": (text.encode(), 0o644, u, g) for rel, text in files.items()})
        entries.update(self.tools)
        trees = [(tree, self.workdir, u, g, False)] if tree else []
        if self.site:
            trees.append((self.site, site_target(self.b), 0, 0, True))
        with tempfile.TemporaryFile(prefix="asyncrl-docker-") as f:
            write_tar(f, entries, trees)
            f.seek(0)
            self._docker(copy_in_argv(self.b, name), stdin=f, timeout=600)

    def _copy_out(self, name: str, dest: str, keep=None, max_bytes=None, max_files=None) -> None:
        """Container `name`'s workdir into `dest` (untar_into), read as it streams."""
        p = subprocess.Popen(
            copy_out_argv(self.b, name, self.workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        timer = threading.Timer(600.0, p.kill)
        timer.start()
        try:
            untar_into(p.stdout, dest, keep, max_bytes, max_files)
            while p.stdout.read(1 << 16):  # the end of the stream (padding), so that docker exits
                pass
        except BaseException:
            p.kill()
            raise
        finally:
            timer.cancel()
            err = p.stderr.read()
            rc = p.wait()
            p.stdout.close()
            p.stderr.close()
        if rc != 0:
            raise RuntimeError(f"cp exited {rc}: {err.decode('utf-8', 'replace').strip()[-300:]}")

    def run(
        self,
        command: str,
        limits: BashLimits,
        name: str | None = None,
        user: str | None = None,
        workdir: str | None = None,
        pythonpath: list[str] | None = None,
    ) -> SandboxResult:
        t0 = time.perf_counter()
        if name is None and self.stopped:  # stopped for scoring: up again, without the old processes
            try:
                self._docker(start_argv(self.b, self.name))
                self.stopped = False
            except RuntimeError as e:
                return SandboxResult(f"sandbox error: {e}", -1, wall_s=0.0, isolation=["docker"])
        argv = exec_argv(
            self.b,
            name or self.name,
            workdir or self.workdir,
            command,
            limits,
            user,
            self.pythonpath if pythonpath is None else pythonpath,
        )
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
        """The local backend's scoring (envs/scoring_run.py) on this container's tree: the episode's
        container is stopped and its workdir copied out; the scoring copy is built here and run in a
        fresh container from the image (see the module docstring)."""
        self.score_info = ScoreInfo()
        score = f"{self.name}-score"
        lim = BashLimits(
            **{
                **limits.command.__dict__,
                "wall_s": limits.score_wall_s,
                "cpu_s": int(limits.score_wall_s) + 1,
                "keep_bytes": max(limits.command.keep_bytes, 4 << 20),
            }
        )  # every report line, as the local backend
        with tempfile.TemporaryDirectory(prefix="asyncrl-docker-score-") as tmp:
            repo, dest = os.path.join(tmp, "repo"), os.path.join(tmp, "score")
            try:
                if not self.stopped:  # what the episode left running ends (a container that
                    # stopped by itself already has nothing running: kill's complaint is moot)
                    _quiet(kill_argv(self.b, self.name))
                    self.stopped = True
                self._copy_out(
                    self.name, repo, max_bytes=limits.workspace_mb << 20, max_files=limits.workspace_files
                )
                if self.from_image:  # the pristine tree: the image's workdir
                    image = f"{self.name}-image"
                    try:
                        self._docker(create_argv(self.b, image, self.image), timeout=300)
                        self._copy_out(image, os.path.join(tmp, "image"))
                    finally:
                        _quiet(rm_argv(self.b, image))
                    task = dataclasses.replace(task, base_dir=os.path.join(tmp, "image"))
            except TreeTooBig as e:
                return {}, f"workspace is {e} at scoring"
            except (RuntimeError, ValueError, OSError) as e:
                self.score_info.infra = "sandbox"
                return {}, f"scoring container failed: {e}"

            def run(command: str) -> SandboxResult:
                t0 = time.perf_counter()
                try:
                    self._docker(create_argv(self.b, score, self.image, self.mounts), timeout=300)
                    self._docker(start_argv(self.b, score))
                    self._setup_run(score, clear=True, probe=False)
                    self._copy_in(score, dest, {})
                    res = self.run(command, lim, name=score)
                    if not res.reason.startswith("sandbox error"):
                        # what the test run left of the test infrastructure (tamper.run_flags reads it)
                        shutil.rmtree(dest)
                        self._copy_out(score, dest, keep=lambda rel: bool(scoring_copy.infra_kind(rel, task)))
                    return res
                except (RuntimeError, ValueError, OSError) as e:
                    return SandboxResult(
                        f"sandbox error: scoring container: {e}",
                        -1,
                        wall_s=time.perf_counter() - t0,
                        isolation=["docker"],
                    )

            try:
                status, detail, self.score_info = scoring_run.score(
                    task, repo, dest, self.b.tools, run, lambda d: None
                )  # the copy's owner is set by the tar
            finally:
                _quiet(rm_argv(self.b, score))
        return status, detail

    def close(self) -> None:
        if self.created:
            _quiet(rm_argv(self.b, self.name))
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
