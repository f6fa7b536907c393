"""A run config as one typed tree: `[up]`, `[layout]`, `[trainer]`, `[worker]` and `[scorer]` of a
run TOML (deploy/*.toml), each process's table built with that process's own class, the
`ASYNCRL_*` environment applied to each the way the process itself applies it (the file's value
wins over the environment's, as `up` hands the table to the child).

    tree = build_run(tomllib.loads(text))        ConfigError naming the table, key and value

What no single process can see is a validator on the tree (cross_check, naming both sides): the
tokenizer (the same spec or file contents; a chat template when [trainer.tasks] chat_template is
on), the swe task set and turn length, max_lag, the signing key pair (asyncrl/config_check.py
documents each). Building the tree is the check: `asyncrl config check FILE` and `asyncrl up` both
build it. A sync run (`[up] sync = true`, or `up --sync`) is exempt from the max_lag agreement.
An unknown top-level table is an unknown key like any other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, model_validator

from asyncrl import thread_plan
from asyncrl.layout import LayoutConfig
from asyncrl.upconfig import UpConfig
from bus import BusConfig
from kernel.config import ConfigError, build, config_class, env_overrides, merge
from rollout_worker.config import WorkerConfig
from scorer.config import ScorerConfig
from trainer.config import TrainerConfig

PROCESSES = {"trainer": TrainerConfig, "worker": WorkerConfig, "scorer": ScorerConfig}


def _layout(v: Any) -> Any:
    return LayoutConfig.from_dict(v) if isinstance(v, dict) else v  # its own checks and messages


@config_class
class RunConfig:
    up: UpConfig = field(default_factory=UpConfig)
    layout: Annotated[LayoutConfig | None, BeforeValidator(_layout)] = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)

    @model_validator(mode="after")
    def _processes_agree(self):
        cross_check(self, sync=self.up.sync)
        return self

    @property
    def bus(self) -> BusConfig:
        """The run's bus: every process connects to the same one (`up` gives each its address)."""
        return self.trainer.bus

    def __getitem__(self, table: str):
        """tree["trainer"]: a table by its TOML name (what layout.plan and the checks read)."""
        return getattr(self, table)


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


def build_run(conf: dict, environ=None, sync: bool = False) -> RunConfig:
    """The tree of a parsed run TOML; `sync` (up --sync) as if `[up] sync = true`."""
    env = os.environ if environ is None else environ
    thread_plan.configured(conf)  # each section's `threads` as `up` plans them, before the tables
    values = dict(conf)
    if sync:
        values["up"] = {**(conf.get("up") or {}), "sync": True}
    for name, cls in PROCESSES.items():
        table = conf.get(name, {})
        values[name] = merge(env_overrides(cls, "ASYNCRL_", env), table) if isinstance(table, dict) else table
    return build(RunConfig, values)


def tables(tree: RunConfig, conf: dict) -> dict:
    """{table: what `asyncrl config check` prints}: [up] as given, the rest resolved."""
    out: dict = {"up": dict(conf.get("up", {}))}
    if tree.layout is not None:
        out["layout"] = dataclasses.asdict(tree.layout)
    out.update({name: getattr(tree, name) for name in PROCESSES})
    return out
