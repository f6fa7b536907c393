"""Typed configuration: one pydantic dataclass per process and per section, filled from a TOML file
then env overrides.

    cfg = load_config(ScorerConfig, "deploy/demo.toml", section="scorer")
    ASYNCRL_RUN__CONCURRENCY=16  ASYNCRL_BUS__SERVERS=nats://a:4222,nats://b:4222   (nested with "__")

A config class is declared with `@config_class`: a real dataclass (dataclasses.replace, asdict and
fields work on it) validated by pydantic, every field's bounds, choices and description on the
field itself (Annotated[int, Field(ge=1, description=...)], Literal[...]), what two fields must
agree on in a validator. Env values are strings: pydantic parses numbers and bools from them, a
list field (`CsvList`) also takes "a,b,c". Any error is a ConfigError naming the table, the key
and the value: `[scorer.run] concurrency: Input should be greater than or equal to 1 (got 0)`; an
unknown key gets the nearest known one (`[trainer.optim] unknown key 'lrr'; did you mean 'lr'?`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, TypeVar

import pydantic
from pydantic import BeforeValidator, ConfigDict, TypeAdapter, ValidationError


class ConfigError(ValueError):
    pass


# numbers are accepted for string keys (a TOML `rdzv_id = 7`), unknown keys refused
CONFIG = ConfigDict(extra="forbid", coerce_numbers_to_str=True)


def config_class(cls=None, *, config_extra: dict | None = None, **kw):
    """@config_class: a pydantic dataclass with the config's rules (extra keys refused);
    `config_extra` adds pydantic settings, `kw` goes to the dataclass (frozen=True). A class
    attribute `TABLE: ClassVar[str]` names its table in the errors of a direct construction."""
    if cls is None:
        return functools.partial(config_class, config_extra=config_extra, **kw)
    cls = pydantic.dataclasses.dataclass(cls, config=ConfigDict(**CONFIG, **(config_extra or {})), **kw)
    init = cls.__init__

    # built directly (tests, dataclasses.replace): the same ConfigError as from a file, named by class
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except ValidationError as e:
            table = getattr(type(self), "TABLE", "")  # a process's config: its run-config table
            head = "" if table else f"{type(self).__name__}: "
            raise ConfigError(head + error_text(type(self), e, table)) from None

    cls.__init__ = __init__
    return cls


def _split_csv(v: Any) -> Any:
    return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v


def _none_word(v: Any) -> Any:
    return None if isinstance(v, str) and v.strip().lower() in ("", "none", "null") else v


T = TypeVar("T")
# a list that an env variable gives as "a,b,c"
CsvList = Annotated[list[T], BeforeValidator(_split_csv)]
# an optional value that an env variable unsets with "", "none" or "null"
Maybe = Annotated[T | None, BeforeValidator(_none_word)]


def _is_config(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls, include_extras=False)


def _names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _walk(cls, loc: tuple) -> tuple[type | None, list[str], list]:
    """Along an error's location: (the innermost config class, the section names leading to it,
    the rest of the location: its key and list indices)."""
    sections: list[str] = []
    for i, part in enumerate(loc):
        if not _is_config(cls) or part not in _names(cls):
            return cls, sections, list(loc[i:])
        tp = _hints(cls)[part]
        if not _is_config(tp):
            return cls, sections, list(loc[i:])
        cls = tp
        sections.append(part)
    return cls, sections, []


def _message(cls, err: dict, base: str) -> str:
    inner, sections, rest = _walk(cls, tuple(err["loc"]))
    table = ".".join(p for p in (base, *sections) if p)
    head = f"[{table}] " if table else ""
    kind, msg = err["type"], err["msg"]
    if kind in ("unexpected_keyword_argument", "extra_forbidden") and rest:
        return f"{head}unknown key '{rest[0]}'; {_nearest(inner, str(rest[0]), table)}"
    if kind == "value_error":  # a validator's own message names its keys and values
        msg = msg.removeprefix("Value error, ")
        if msg.startswith("["):  # it names its own table
            return msg
        return f"{head}{_key(rest)}: {msg}" if rest else f"{head}{msg}"
    if kind == "dataclass_type" or (not rest and "dataclass" in kind):
        return f"{head}expected a table, got {err.get('input')!r}"
    return f"{head}{_key(rest)}: {msg} (got {err.get('input')!r})"


def _nearest(cls, key: str, table: str) -> str:
    """The hint for an unknown key: the nearest key of its own table, else the same or a near key
    in one of its sections (an old flat key: `lr` at the top is [trainer.optim] lr)."""
    if not _is_config(cls):
        return "no keys here"
    near = difflib.get_close_matches(key, _names(cls), n=1)
    if near:
        return f"did you mean '{near[0]}'?"
    inner = {}
    for sect, tp in _hints(cls).items():
        if _is_config(tp):
            inner.update({(sect, k): k for k in _names(tp) if (sect, k) not in inner})
    for want in ([key], difflib.get_close_matches(key, list(set(inner.values())), n=1)):
        for (sect, k), name in inner.items():
            if want and name == want[0]:
                return f"did you mean [{'.'.join(p for p in (table, sect) if p)}] {k}?"
    return f"known: {', '.join(_names(cls))}"


def _key(rest: list) -> str:
    out = ""
    for p in rest:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def error_text(cls, e: ValidationError, table: str = "") -> str:
    """Every problem of a ValidationError on `cls`, each naming its table, key and value."""
    seen: list[str] = []
    for err in e.errors():
        m = _message(cls, err, table)
        if m not in seen:
            seen.append(m)
    return "; ".join(seen)


@functools.cache
def _adapter(cls) -> TypeAdapter:
    if not hasattr(cls, "__pydantic_validator__") and not hasattr(cls, "__pydantic_config__"):
        cls.__pydantic_config__ = CONFIG  # a plain dataclass: the same rules as a config_class
    return TypeAdapter(cls)


def build(cls, values: dict, where: str = "", table: str = ""):
    """A config class from a plain dict (nested tables for nested sections), checked like a file.
    `table` (and `where` below it) names the file's table in errors."""
    base = ".".join(p for p in (table, where) if p)
    if not isinstance(values, dict):
        raise ConfigError(f"{f'[{base}] ' if base else ''}expected a table, got {values!r}")
    bools = _bools_for_numbers(cls, values, base)
    if bools:
        raise ConfigError("; ".join(bools))
    try:
        return _adapter(cls).validate_python(values)
    except ValidationError as e:
        raise ConfigError(error_text(cls, e, base)) from None


def _bools_for_numbers(cls, values: dict, table: str) -> list[str]:
    """`max_turns = true` is a mistake pydantic would read as 1: a bool for a number is refused."""
    out = []
    hints = _hints(cls)
    for k, v in values.items():
        tp = hints.get(k)
        if _is_config(tp) and isinstance(v, dict):
            out += _bools_for_numbers(tp, v, ".".join(p for p in (table, k) if p))
        elif isinstance(v, bool) and tp in (int, float):
            head = f"[{table}] " if table else ""
            out.append(
                f"{head}{k}: Input should be a valid {'integer' if tp is int else 'number'}, "
                f"not a bool (got {v!r})"
            )
    return out


def _set_path(d: dict, path: list[str], value: str) -> None:
    for p in path[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"env override {'__'.join(path)}: {p} is not a table")
    d[path[-1]] = value


def env_overrides(cls, env_prefix: str, environ) -> dict:
    """ASYNCRL_FOO__BAR=1 -> {"foo": {"bar": "1"}}, only for keys that exist in cls: other processes'
    variables share the prefix, so unrelated names are ignored, not errors."""
    out: dict = {}
    for key, value in environ.items():
        if not key.startswith(env_prefix):
            continue
        path = key[len(env_prefix) :].lower().split("__")
        _refuse_flat(cls, env_prefix, key, path)
        tp = cls
        for p in path:
            if not (_is_config(tp) and p in _names(tp)):
                break
            tp = _hints(tp)[p]
        else:
            _set_path(out, path, value)
    return out


def _refuse_flat(cls, env_prefix: str, key: str, path: list[str]) -> None:
    """A flat variable naming a section's key (ASYNCRL_SIGNING_KEY, ASYNCRL_CHECKPOINT_DIR) is refused
    with the nested name: ignored like another process's, it would leave updates unsigned or
    checkpoints elsewhere without a word."""
    if len(path) != 1 or not _is_config(cls) or path[0] in _names(cls):
        return
    name, hints = path[0], _hints(cls)
    nested = [
        f"{env_prefix}{sect.upper()}__{k.upper()}"
        for sect, tp in hints.items()
        if _is_config(tp)
        for k in _names(tp)
        if name in (k, f"{sect}_{k}")
    ]
    if nested:
        raise ConfigError(f"env {key}: not a key at the top; did you mean {' or '.join(nested)}?")


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
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


def read_toml(path: str | os.PathLike, section: str | None = None) -> dict:
    """A TOML file (or its `[section]`) as a dict; ConfigError when missing or malformed."""
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
    return values


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
    `table` (default: `section`) names the file's table in errors."""
    table = (section or "") if table is None else table
    values: dict = read_toml(path, section) if path is not None else {}
    if env_prefix:
        values = merge(values, env_overrides(cls, env_prefix, os.environ if environ is None else environ))
    if overrides:
        values = merge(values, overrides)
    return build(cls, values, "", table)
