"""`asyncrl tasks build`: build an offline task set for the multi-turn episodes.

    asyncrl tasks build --out tasks/swe --gen 200 --humaneval 164 --packages inflection,toolz --per-package 20
    asyncrl tasks build --out DIR --sdist ./mypkg-1.0.tar.gz          # a local sdist, no network
    asyncrl tasks import swe.jsonl --out DIR [--repos CLONES]        # SWE-bench-format instances in
                     [--find-links WHEELS | --no-envs]               # each repository's environment
    asyncrl tasks export DIR --out OUT                               # OUT/instances.jsonl + OUT/repos/
    asyncrl tasks evaluate preds.jsonl --tasks DIR | --instances swe.jsonl   # resolved, as SWE-bench
    asyncrl tasks predict DIR --model HF_DIR | --run RUN --out preds.jsonl  # a policy's model_patch per
                                                                     # eval task (asyncrl/predict.py)

Tiers: generated repositories (envs/gen_repos.py), HumanEval stub and bug-fix tasks
(envs/humaneval_tasks.py) and real packages with their own test suites (here): the source
distribution is fetched from the package index at build time (`pip download --no-binary :all:`),
unpacked into DIR/repos/, its tests run with pytest in the sandbox, and each kept task is one
AST mutation of its source that makes >= 1 of the originally passing tests fail. The episode env
reads DIR only (envs/task_set.py). Prints the per-tier / per-kind counts and kept fractions.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from types import SimpleNamespace

import click

from asyncrl.predict import cli as predict_cli
from envs.base import split_of
from envs.episode import EpisodeLimits, EpisodeTask
from envs.mutations import balanced_order, candidates
from envs.repo_env import Builder, EnvError
from envs.sandbox import BashLimits
from envs.task_set import write_task_set
from envs.task_validation import BuildReport, fail_pass_split, run_suite
from kernel.cli import Group, one_of, run

FAMILY = "package"
SKIP_DIRS = {"docs", "doc", "examples", "benchmarks", "bench", ".git", "__pycache__", "build", "dist"}


def fetch_sdist(name: str, dest: str) -> str:
    """Download the newest source distribution of `name` (no dependencies) into `dest`."""
    os.makedirs(dest, exist_ok=True)
    before = set(os.listdir(dest))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
            dest,
            name,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    new = sorted(set(os.listdir(dest)) - before) or sorted(
        f for f in os.listdir(dest) if f.lower().replace("_", "-").startswith(name.lower().replace("_", "-"))
    )
    if r.returncode != 0 or not new:
        raise RuntimeError(f"pip download {name} failed: {(r.stderr or r.stdout).strip()[-500:]}")
    return os.path.join(dest, new[0])


def unpack_sdist(sdist: str, repos_dir: str) -> str:
    """Unpack into repos_dir/<name-version>/ (archive members may not leave it); egg-info,
    caches and compiled files are dropped. Returns the repository directory."""
    tmp = tempfile.mkdtemp(prefix="sdist-", dir=repos_dir)
    try:
        if sdist.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar")):
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
        elif sdist.endswith(".zip"):
            with zipfile.ZipFile(sdist) as z:
                for m in z.namelist():
                    if os.path.isabs(m) or ".." in m.split("/"):
                        raise ValueError(f"{sdist}: member {m!r} leaves the archive")
                z.extractall(tmp)
        else:
            raise ValueError(f"{sdist}: not a source distribution (.tar.gz / .zip)")
        tops = os.listdir(tmp)
        src = (
            os.path.join(tmp, tops[0])
            if len(tops) == 1 and os.path.isdir(os.path.join(tmp, tops[0]))
            else tmp
        )
        name = (
            os.path.basename(src) if src != tmp else os.path.basename(sdist).split(".tar")[0].split(".zip")[0]
        )
        dest = os.path.join(repos_dir, name)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(src, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for d, dirs, files in os.walk(dest, topdown=True):
        for x in [x for x in dirs if x.endswith(".egg-info") or x == "__pycache__"]:
            shutil.rmtree(os.path.join(d, x))
            dirs.remove(x)
        for f in files:
            if f.endswith((".pyc", ".pyo")):
                os.unlink(os.path.join(d, f))
    return dest


def _py_files(repo: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(repo):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        out += [os.path.relpath(os.path.join(d, f), repo) for f in sorted(files) if f.endswith(".py")]
    return out


def is_test_file(rel: str) -> bool:
    base, parts = os.path.basename(rel), rel.split(os.sep)
    return (
        base.startswith("test_")
        or base.endswith("_test.py")
        or any(p in ("tests", "test", "testing") for p in parts[:-1])
    )


def split_repo(repo: str) -> tuple[list[str], list[str]]:
    """(source files to mutate, test files) of an unpacked package."""
    files = _py_files(repo)
    tests = [
        f
        for f in files
        if is_test_file(f)
        and os.path.basename(f) != "conftest.py"
        and (os.path.basename(f).startswith("test_") or f.endswith("_test.py"))
    ]
    src = [f for f in files if not is_test_file(f) and os.path.basename(f) not in ("setup.py", "conftest.py")]
    return src, tests


def build_package(
    sdist: str,
    out_dir: str,
    per_package: int = 10,
    seed: int = 0,
    eval_fraction: float = 0.2,
    tries: int = 4,
    test_timeout_s: float = 120.0,
    report: BuildReport | None = None,
    envs: Builder | None = None,
) -> list[EpisodeTask]:
    """Validated bug-fix tasks of one package's source distribution (repository in out_dir/repos/;
    with `envs`, its declared dependencies in out_dir/envs/<name-version>, envs/repo_env.py)."""
    report = report if report is not None else BuildReport()
    repos = os.path.join(out_dir, "repos")
    os.makedirs(repos, exist_ok=True)
    repo = unpack_sdist(sdist, repos)
    name = os.path.basename(repo)
    src, tests = split_repo(repo)
    if not src or not tests:
        report.notes.append(f"{name}: skipped, {len(src)} source and {len(tests)} test files")
        return []
    env_dir = None
    if envs is not None:
        try:
            env_dir = envs.for_repo(name, repo, {"package": name})
        except EnvError as e:
            shutil.rmtree(repo, ignore_errors=True)
            report.notes.append(f"{name}: skipped, {e}")
            return []
    limits = EpisodeLimits(
        score_wall_s=test_timeout_s, command=BashLimits(wall_s=test_timeout_s, cpu_s=int(test_timeout_s))
    )
    original, why = run_suite({}, "pytest", tests, base_dir=repo, limits=limits, env_dir=env_dir)
    if not any(s == "PASS" for s in original.values()):
        report.notes.append(f"{name}: skipped, no test passes on the original ({why or 'no report'})")
        return []
    n_fail = sum(s != "PASS" for s in original.values())
    if n_fail:
        report.notes.append(
            f"{name}: {n_fail} of {len(original)} tests do not pass on the original; left out"
        )
    hidden = {}
    for t in tests:
        with open(os.path.join(repo, t), encoding="utf-8") as f:
            hidden[t] = f.read()
    rng = random.Random(f"{FAMILY}:{seed}:{name}")
    muts = []
    for path in src:
        with open(os.path.join(repo, path), encoding="utf-8", errors="replace") as f:
            muts += candidates(f.read(), path)
    muts = balanced_order(muts, rng)
    out: list[EpisodeTask] = []
    for m in muts[: per_package * tries]:
        if len(out) >= per_package:
            break
        status, _ = run_suite(
            {m.path: m.source}, "pytest", tests, base_dir=repo, limits=limits, env_dir=env_dir
        )
        f2p, p2p = fail_pass_split(original, status)
        split = (
            split_of(f"{FAMILY}|{name}|{m.path}|{m.line}|{m.after}|{m.kind}", eval_fraction) if f2p else None
        )
        report.add(FAMILY, m.kind, bool(f2p), split)
        if not f2p:
            continue
        shown = ", ".join(f2p[:3]) + (f" and {len(f2p) - 3} more" if len(f2p) > 3 else "")
        out.append(
            EpisodeTask(
                task_id=f"{FAMILY}-{name}-{len(out)}-{m.kind}",
                family=FAMILY,
                split=split,
                instruction=(
                    f"This is the source of the Python package {name}. A bug makes some of its tests fail, "
                    f"for example {shown}.\nFind the bug in the package source and fix it; do not change "
                    f"the tests. Run the tests with `run_tests` (pytest; pass test files or -k to narrow "
                    f"them), then `submit`."
                ),
                files={m.path: m.source},
                hidden_tests=hidden,
                runner="pytest",
                test_paths=tests,
                fail_to_pass=f2p,
                pass_to_pass=p2p,
                base_dir=repo,
                env_dir=env_dir,
                meta={
                    "kind": m.kind,
                    "path": m.path,
                    "line": m.line,
                    "before": m.before,
                    "after": m.after,
                    "package": name,
                },
            )
        )
    return out


# how the repositories' environments are built (envs/repo_env.py): build, import and evaluate take them
ENV_FLAGS = (
    click.option(
        "--find-links",
        default=None,
        metavar="DIR",
        help="install each repository's dependencies from DIR's wheels / sdists only (offline), "
        "not from the package index",
    ),
    click.option(
        "--no-envs",
        is_flag=True,
        help="build no repository environments (the sandbox python's own packages only)",
    ),
    click.option("--env-timeout", type=float, default=900.0, help="seconds for one environment's install"),
)


def env_flags(f):
    for option in reversed(ENV_FLAGS):  # decorators apply bottom-up: keep the listed order in --help
        f = option(f)
    return f


def env_builder(a, out_dir: str) -> Builder | None:
    if a.no_envs:
        return None
    return Builder(os.path.join(out_dir, "envs"), a.find_links, a.env_timeout)


def import_command(a) -> int:
    """`asyncrl tasks import`: every usable instance imported, each other one listed with why; the
    set is written whole (envs/task_set.py staged) or, when no instance imports, not at all."""
    from envs import swebench
    from envs.task_set import staged

    if a.split not in ("train", "eval"):
        raise swebench.InstanceError(f"--split must be train or eval, got {a.split!r}")
    with staged(a.out) as stage:
        envs = env_builder(a, stage)
        got = swebench.import_each(a.instances, stage, a.repos, a.split, envs)
        for line in skipped_lines(got.skipped):
            print(line, file=sys.stderr)
        built = envs.summary() if envs else {}
        for key, e in built.items():
            if "installed" in e:
                print(
                    f"environment {key}: {', '.join(e['installed']) or 'nothing to install'}", file=sys.stderr
                )
        if not got.tasks:
            print(f"imported none of {got.total} instances: nothing written to {a.out}", file=sys.stderr)
            raise NothingImported
        report = {
            "imported_from": os.path.abspath(a.instances),
            "instances": len(got.tasks),
            "skipped": got.skipped,
            "environments": built,
        }
        write_task_set(stage, got.tasks, report)
    splits = {s: sum(t.split == s for t in got.tasks) for s in ("train", "eval")}
    print(
        f"imported {len(got.tasks)} of {got.total} instances into {a.out} ({splits['train']} train, "
        f"{splits['eval']} eval); {len(got.skipped)} skipped"
        + (" (listed above and in its manifest.json)" if got.skipped else ""),
        file=sys.stderr,
    )
    for s, n in splits.items():
        if not n:
            print(
                f"note: the {s} split has no tasks; the `swe` env needs both (--split, or a `split` "
                f"field per instance)",
                file=sys.stderr,
            )
    return 0


def skipped_lines(skipped: list[dict]) -> list[str]:
    """One line per skipped instance: where it is in the file, its id, the field and why."""
    return [
        f"skipped {s['reason']}"
        if s["reason"].startswith(f"{s['where']}:")
        else f"skipped {s['where']}: {s['reason']}"
        for s in skipped
    ]


class NothingImported(Exception):
    """No instance of the file could be imported (each one's reason is printed)."""


def scoring_backend(a):
    """`tasks evaluate --workspace`: None (the local sandbox) or the container backend."""
    if a.workspace != "docker":
        return None
    from envs.workspace_docker import DockerBackend

    return DockerBackend(image=a.docker_image) if a.docker_image else DockerBackend()


def swebench_command(a) -> int:
    from envs import swebench
    from envs.task_set import load_task_set

    try:
        if a.cmd == "import":
            try:
                return import_command(a)
            except NothingImported:
                return 1
        if a.cmd == "export":
            path, notes = swebench.export_tasks(load_task_set(a.tasks, split=a.split), a.out)
            for n in notes:
                print(n, file=sys.stderr)
            print(path)
            return 0
        preds = swebench.read_jsonl(a.predictions)
        with tempfile.TemporaryDirectory(prefix="swebench-eval-") as tmp:
            skipped = {}
            if a.tasks:
                tasks = load_task_set(a.tasks)
            else:
                got = swebench.import_each(a.instances, tmp, a.repos, envs=env_builder(a, tmp))
                tasks, skipped = got.tasks, {s["instance"]: s["reason"] for s in got.skipped}
                for line in skipped_lines(got.skipped):
                    print(line, file=sys.stderr)
            report = swebench.evaluate_predictions(tasks, preds, skipped=skipped, backend=scoring_backend(a))
    except (ValueError, OSError) as e:  # InstanceError is a ValueError
        print(f"asyncrl tasks {a.cmd}: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2, sort_keys=True)
    if a.report:
        with open(a.report, "w") as f:
            f.write(text)
    print(text)
    return 0


@click.group("tasks", cls=Group, help=__doc__)
def cli() -> None:
    pass


@cli.command("build", short_help="build a task set into --out")
@click.option("--out", required=True)
@click.option("--seed", type=int, default=0)
@click.option("--eval-fraction", type=float, default=0.2)
@click.option("--gen", type=int, default=0, help="generated repositories (tier 1)")
@click.option(
    "--min-eval",
    type=int,
    default=None,
    help="tier 1: add eval repositories until the eval split holds this many tasks (default 16)",
)
@click.option(
    "--functions",
    default="",
    help="tier 1: comma-separated bank functions (envs/repo_bank.py), or DEMO for the swe-demo bank",
)
@click.option("--modules", type=int, default=2, help="tier 1: modules per generated repository")
@click.option("--humaneval", type=int, default=0, help="HumanEval problems (tier 2), -1 for all 164")
@click.option("--packages", default="", help="comma-separated PyPI names (tier 3), fetched now")
@click.option("--sdist", multiple=True, help="a local source distribution (tier 3), repeatable")
@click.option("--per-package", type=int, default=10)
@click.option("--test-timeout", type=float, default=120.0, help="seconds for one run of a package's tests")
@click.option("--json", "as_json", is_flag=True, help="print the build report as JSON")
@env_flags
def build_command(**flags) -> int:
    a = SimpleNamespace(**flags)
    if not 0 <= a.eval_fraction < 1:
        raise click.UsageError("--eval-fraction must be in [0, 1)")
    from envs import gen_repos

    report, tasks = BuildReport(), []
    if a.gen:
        from envs.swe_env import DEMO_FUNCTIONS

        fns = (
            DEMO_FUNCTIONS
            if a.functions == "DEMO"
            else tuple(f.strip() for f in a.functions.split(",") if f.strip())
        )
        try:
            tasks += gen_repos.build(
                a.gen,
                seed=a.seed,
                eval_fraction=a.eval_fraction,
                report=report,
                min_eval=gen_repos.MIN_EVAL if a.min_eval is None else a.min_eval,
                n_modules=a.modules,
                functions=fns or None,
            )
        except ValueError as e:
            raise click.UsageError(f"--functions / --modules: {e}") from None
    if a.humaneval:
        from envs import humaneval_tasks

        tasks += humaneval_tasks.build(
            None if a.humaneval < 0 else a.humaneval,
            seed=a.seed,
            eval_fraction=a.eval_fraction,
            report=report,
        )
    sdists = list(a.sdist)
    if a.packages:
        cache = os.path.join(a.out, "sdists")
        for name in [p.strip() for p in a.packages.split(",") if p.strip()]:
            try:
                sdists.append(fetch_sdist(name, cache))
            except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                report.notes.append(f"{name}: not fetched: {e}")
    envs = env_builder(a, a.out)
    for sd in sdists:
        tasks += build_package(
            sd,
            a.out,
            a.per_package,
            a.seed,
            a.eval_fraction,
            test_timeout_s=a.test_timeout,
            report=report,
            envs=envs,
        )
    write_task_set(a.out, tasks, report.to_dict())
    print(json.dumps(report.to_dict(), indent=2) if a.as_json else report.render())
    print(f"wrote {len(tasks)} tasks to {a.out}", file=sys.stderr)
    return 0 if tasks else 1


@cli.command("stats", short_help="counts of a built task set")
@click.argument("path")
def stats_command(path: str) -> int:
    from collections import Counter

    from envs.task_set import load_task_set

    ts = load_task_set(path)
    print(
        json.dumps(
            {f"{f}/{sp}": n for (f, sp), n in sorted(Counter((t.family, t.split) for t in ts).items())},
            indent=2,
        )
    )
    return 0


@cli.command(
    "import",
    short_help="SWE-bench / SWE-Gym / SWE-smith instances (JSONL) -> a task set",
    help="Each instance that cannot be used is skipped with one line naming it, the field "
    "and why; the rest are imported. Exit 0 when any instance imported, 1 when none did (nothing "
    "written), 2 when the file cannot be read. --out is replaced only by a whole new set.",
)
@click.argument("instances")
@click.option("--out", required=True)
@click.option("--repos", default=None, help="directory of git clones named <owner>__<name>")
@click.option("--split", default="train", help="split of instances that name none (train | eval)")
@env_flags
def import_cli(**flags) -> int:
    return swebench_command(SimpleNamespace(cmd="import", **flags))


@cli.command("export", short_help="a task set -> SWE-bench instances (DIR/instances.jsonl + DIR/repos/)")
@click.argument("tasks")
@click.option("--out", required=True)
@click.option("--split", default=None)
def export_cli(**flags) -> int:
    return swebench_command(SimpleNamespace(cmd="export", **flags))


@cli.command("evaluate", short_help="score model_patch predictions as the SWE-bench harness does")
@click.argument("predictions")
@click.option("--tasks", help="an imported (or built) task set")
@click.option("--instances", help="an instance file (imported into a temporary task set first)")
@click.option("--repos", default=None, help="with --instances: directory of <owner>__<name> clones")
@env_flags
@click.option(
    "--workspace",
    type=click.Choice(("local", "docker")),
    default="local",
    help="where each prediction's tests run: the local sandbox, or a container per run (needs a"
    " docker daemon; as the worker's [worker.episodes] workspace)",
)
@click.option("--docker-image", default="", help="--workspace docker: the image (a task's own image wins)")
@click.option("--report", default=None, help="also write the report (JSON) here")
def evaluate_cli(**flags) -> int:
    a = SimpleNamespace(cmd="evaluate", **flags)
    one_of(a, "tasks", "instances", required=True)
    return swebench_command(a)


cli.add_command(predict_cli)


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "asyncrl tasks")


if __name__ == "__main__":
    sys.exit(main())
