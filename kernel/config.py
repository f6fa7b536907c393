"""Typed configuration: one @dataclass per process, filled from a TOML file then env overrides.

    cfg = load_config(ScorerConfig, "deploy/demo.toml", section="scorer")
    ASYNCRL_RUN__CONCURRENCY=16  ASYNCRL_BUS__SERVERS=nats://a:4222,nats://b:4222   (nested with "__")

Values are coerced to the declared type (int, float, bool, str, list[...], optional, nested
dataclass); an unknown key or a value that does not parse raises ConfigError naming it.

A config class may list keys that moved into one of its sections, as a class attribute
`MOVED = {"lr": "optim.lr"}`: such a key (in a file, a dict, or a flat env variable) is refused
with its new place (`lr: moved to [trainer.optim] lr`), every moved key present named at once.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    pass


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str, table: str = "") -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            if len(args) < len(typing.get_args(tp)):
                return None
        errors = []
        for a in args:
            try:
                return _coerce(value, a, where, table)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table for {tp.__name__}, got {value!r}")
        return _build(tp, value, where, table)
    if origin in (list, tuple):
        inner = (typing.get_args(tp) or (str,))[0]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected a bool, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected {tp.__name__}, got a bool")
        try:
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return tp(value) if not (tp is int and isinstance(value, str)) else int(value, 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value  # Any / unannotated


def same_keys(*keys: str) -> dict[str, str]:
    """{key: key}: keys that kept their name when they moved into a section."""
    return {k: k for k in keys}


def moved_map(moves: dict[str, dict[str, str]]) -> dict[str, str]:
    """{section: {old flat key: new key}} -> the MOVED map {old key: "section.new key"}."""
    return {old: f"{sect}.{new}" for sect, m in moves.items() for old, new in m.items()}


def build_sections(obj, table: str) -> None:
    """In a sectioned config's __post_init__: a section given as a dict (tests, overrides) is
    built and checked like its TOML table, so a bad key or value gets the same error."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, dict):
            setattr(obj, f.name, build(hints[f.name], v, f.name, table))


def check_section(table: str, obj, checks: dict[str, bool], hints: dict[str, str] | None = None) -> None:
    """In a section's __post_init__: one ValueError naming every bad key of `[table]` with its value
    (and a hint where `hints` has one for it): `[scorer.run] invalid value for concurrency: concurrency=0`."""
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        hint = "".join(f"; {k}: {hints[k]}" for k in bad if hints and k in hints)
        raise ValueError(
            f"[{table}] invalid value for {', '.join(bad)}: "
            + ", ".join(f"{k}={getattr(obj, k)!r}" for k in bad)
            + hint
        )


def moved_keys(cls) -> dict[str, str]:
    """{old key: new dotted path} of a config class (its MOVED class attribute; {} without one)."""
    return dict(getattr(cls, "MOVED", {}) or {})


def _moved_error(cls, keys: list[str], where: str, table: str) -> ConfigError:
    """One message naming the new place of every moved key present (nothing lost: fix all at once)."""
    moved = moved_keys(cls)
    base = ".".join(p for p in (table, where) if p)
    parts = []
    for k in keys:
        *sect, name = moved[k].split(".")
        parts.append(f"{k}: moved to [{'.'.join(p for p in (base, *sect) if p)}] {name}")
    return ConfigError("old flat key(s): " + "; ".join(parts))


def _build(cls, values: dict, where: str, table: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    # moved: gone from cls, or now the name of a section and given a plain value (publish = "sharded")
    moved = sorted(
        k
        for k in values
        if k in moved_keys(cls)
        and (k not in names or (_is_dataclass_type(hints[k]) and not isinstance(values[k], (dict, hints[k]))))
    )
    if moved:
        raise _moved_error(cls, moved, where, table)
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{where or cls.__name__}: unknown key(s) {unknown}; known: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k, table) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


def build(cls, values: dict, where: str = "", table: str = ""):
    """A config dataclass from a plain dict (nested tables for nested sections), checked like a
    file: unknown and moved keys refused, values coerced. `table` names the file's table in errors."""
    return _build(cls, values, where, table)


def _set_path(d: dict, path: list[str], value: str) -> None:
    for p in path[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"env override {'__'.join(path)}: {p} is not a table")
    d[path[-1]] = value


def _env_overrides(cls, env_prefix: str, environ, table: str = "") -> dict:
    """ASYNCRL_FOO__BAR=1 -> {"foo": {"bar": "1"}}, only for fields that exist in cls (other
    processes' variables share the prefix, so unrelated names are ignored, not errors). A moved
    key (cls.MOVED) is refused with its new variable: ignored, an old ASYNCRL_SIGNING_KEY or
    ASYNCRL_CHECKPOINT_DIR would silently leave updates unsigned or checkpoints elsewhere."""
    out: dict = {}
    for key, value in environ.items():
        if not key.startswith(env_prefix):
            continue
        path = key[len(env_prefix) :].lower().split("__")
        tp, ok = cls, True
        for i, p in enumerate(path):
            fields = {f.name: f for f in dataclasses.fields(tp)} if _is_dataclass_type(tp) else {}
            # moved: gone from tp, or now a section's name and given a plain value (ASYNCRL_ENGINE=vllm)
            section = p in fields and i == len(path) - 1 and _is_dataclass_type(typing.get_type_hints(tp)[p])
            if p not in fields or section:
                if _is_dataclass_type(tp) and p in moved_keys(tp):
                    new = path[:i] + moved_keys(tp)[p].split(".")
                    msg = _moved_error(tp, [p], ".".join(path[:i]), table)
                    raise ConfigError(f"env {key}: {msg}: set {env_prefix}{'__'.join(new).upper()}")
                if section:  # a plain value for a table: the loader says so
                    break
                ok = False
                break
            tp = typing.get_type_hints(tp)[p]
        if ok:
            _set_path(out, path, value)
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


RUN_TABLES = ("up", "trainer", "worker", "scorer")  # the top-level tables of a run TOML (deploy/*.toml)


def run_section(path: str | os.PathLike | None, section: str) -> str | None:
    """`section` when `path` is a whole run TOML (any of RUN_TABLES at its top: the file `asyncrl
    up` takes and the deployment installs once, /etc/asyncrl/run.toml), else None (a file of this
    process's own keys). A run TOML without the process's table gives it its defaults. A missing or
    unparsable file: None, and load_config reports it."""
    if path is None or not Path(path).is_file():
        return None
    try:
        top = tomllib.loads(Path(path).read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None
    return section if any(isinstance(top.get(t), dict) for t in RUN_TABLES) else None


def load_config(
    cls,
    path: str | os.PathLike | None = None,
    env_prefix: str = "ASYNCRL_",
    *,
    section: str | None = None,
    overrides: dict | None = None,
    environ=None,
    table: str | None = None,
):
    """TOML file (optionally one `[section]` of it), then env overrides, then `overrides`.
    `table` (default: `section`) names the file's table in the errors about moved keys."""
    table = (section or "") if table is None else table
    values: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            values = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p}: invalid TOML: {e}") from None
        if section is not None:
            values = values.get(section, {})
            if not isinstance(values, dict):
                raise ConfigError(f"config file {p}: [{section}] is not a table")
    if env_prefix:
        values = _merge(
            values, _env_overrides(cls, env_prefix, os.environ if environ is None else environ, table)
        )
    if overrides:
        values = _merge(values, overrides)
    return _build(cls, values, "", table)
