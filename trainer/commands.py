"""Rank bookkeeping and the registry of collectives: what rank 0 tells the other ranks to run.

Only rank 0 talks to the bus. Anything every rank must join (a step, gathering the published
weights, a sharded checkpoint, the warm start) is a *collective*: a frozen dataclass whose typed
fields are its arguments and whose `run(target)` is what each rank does. Rank 0 issues one with
`collective(cmd, target)`: the command object is broadcast first, then rank 0 runs that same
object; the other ranks sit in `follow`, receive it, check it and run it. Every rank therefore
issues the same torch.distributed collectives in the same order (a rank that issued a different
one, or none, would pair its all-gathers with the wrong peer and hang or abort the group).

A collective declares the rank-local object it runs on (`class Step(Collective[dict], on=Learner)`);
a follower runs it on its own object of that class. Defining the class registers it: a follower
refuses anything that is not a registered collective or whose fields do not match their types.
The concerns that own the collectives define them next to the state they run on (trainer/learner.py,
trainer/checkpoint_state.py, trainer/published.py, trainer/warmstart.py, trainer/dist.py)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Generic, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast_obj(obj=None):
    """Rank 0's object to every rank (identity with one process)."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class CommandError(TypeError):
    """Not a registered collective, one with an argument of the wrong type, or no object to run it on."""


_REGISTRY: dict[str, type[Collective]] = {}


class Collective(Generic[T]):
    """Base of every collective: subclass it as a frozen dataclass, naming the class of the
    rank-local object `run` takes (`on=`); `run` returns T (rank 0 uses it; the followers drop it).

    `last = True` (class keyword): the followers leave their loop after running it (Stop).
    `wire()` is what the other ranks receive; the default is the command itself. A command whose
    rank 0 holds something the others must not get (a callback, state dicts rank 0 alone read)
    returns a copy without it: same class, same `run`."""

    on: ClassVar[type]
    last: ClassVar[bool] = False

    def __init_subclass__(cls, *, on: type, last: bool = False, **kw):
        super().__init_subclass__(**kw)
        cls.on, cls.last = on, last
        _REGISTRY[name_of(cls)] = cls  # a reloaded module's class replaces its old one

    def wire(self) -> Collective[T]:
        return self

    def run(self, target) -> T:
        raise NotImplementedError


def name_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def registered() -> dict[str, type[Collective]]:
    """{name: class} of every collective defined so far (its module imported)."""
    return dict(_REGISTRY)


def check(cmd) -> Collective:
    """`cmd` if it is a registered collective whose fields match their annotations; else CommandError."""
    cls = type(cmd)
    if not isinstance(cmd, Collective) or _REGISTRY.get(name_of(cls)) is not cls:
        raise CommandError(
            f"not a registered collective: {cls.__module__}.{cls.__qualname__} {cmd!r:.120} "
            f"(registered: {', '.join(sorted(_REGISTRY))})"
        )
    for field, hint in _fields(cls).items():
        value = getattr(cmd, field)
        if not _conforms(value, hint):
            raise CommandError(f"{name_of(cls)}.{field}: expected {hint}, got {type(value).__name__}")
    return cmd


@functools.cache
def _fields(cls: type) -> dict[str, Any]:
    """{field: resolved type} of a collective; raises CommandError unless it is a frozen dataclass."""
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise CommandError(f"collective {name_of(cls)} is not a frozen dataclass")
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _conforms(value, hint) -> bool:
    """isinstance against an annotation: classes, `X | None`, list[X], tuple[X, ...], dict[K, V],
    Callable, Any (an int passes as a float)."""
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if origin is None:
        if hint is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return isinstance(value, hint)
    if origin is Callable:
        return callable(value)
    if not isinstance(value, origin):
        return False
    if origin is list and args:
        return all(_conforms(v, args[0]) for v in value)
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(_conforms(v, a) for v, a in zip(value, args))
    if origin is dict and args:
        return all(_conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items())
    return True


def _target(cmd: Collective, targets: Iterable[object]):
    for t in targets:
        if isinstance(t, cmd.on):
            return t
    raise CommandError(f"{name_of(type(cmd))} runs on a {cmd.on.__qualname__}: this rank holds none")


def collective(cmd: Collective[T], target) -> T:
    """Run `cmd` on every rank: on rank 0 of a group it is broadcast first (the followers run it
    from `follow`), then run here on `target`. With one process it just runs; on a rank > 0 outside
    the followers' loop it runs here only (that rank's peers must be running it too)."""
    check(cmd)
    if not isinstance(target, cmd.on):
        raise CommandError(
            f"{name_of(type(cmd))} runs on a {cmd.on.__qualname__}, not a {type(target).__name__}"
        )
    rank, ws = world()
    if ws > 1 and rank == 0:
        broadcast_obj(check(cmd.wire()))
    return cmd.run(target)


def follow(targets: Iterable[object], receive: Callable[[], object] = broadcast_obj) -> None:
    """Ranks > 0: run each collective rank 0 sends, on this rank's object of its class, until one
    that is `last`. `receive` is rank 0's broadcast (a test feeds commands to one process)."""
    targets = list(targets)
    while True:
        cmd = check(receive())
        cmd.run(_target(cmd, targets))
        if cmd.last:
            return
