"""Checks of the numbers events carry, whole lists at once: element types, finiteness, ranges.

    a = float_array(where, "logprobs", values, lo=MIN_LOGPROB, hi=0.0)   # -> float64 array
    a = int_array(where, "completion_ids", values, lo=0, hi=MAX_ID)      # -> int64 array, hi exclusive
    check_float(where, "wall_s", v, 0.0, MAX_WALL_S); check_int(where, "epoch", v, 0, INT64)

Each raises `EventError` whose reason names the field and, for a list, the index of the first
bad element: `Rollout r-0: logprobs[3] = nan is not finite`. Lists are checked in C (one
`map(type, ...)` for the element types, then numpy), never a Python loop per element: a rollout
may carry 131,072 tokens. Bounds say what no healthy process sends (a logprob below -1e4, a
wall time of months): such values are a broken or hostile sender, and the trainer would turn
them into NaN/inf weights downstream.
"""

from __future__ import annotations

import math

import numpy as np

from bus.errors import EventError

INT64 = 1 << 63  # every int must fit int64: |v| < 2**63 (msgpack also carries uint64)
MAX_ID = 1 << 31  # token ids: [0, 2**31); the consumer that knows the vocabulary checks it
MAX_VERSION = 1 << 53  # policy versions (and epochs) far beyond any run
MIN_LOGPROB = -1e4  # a sampled token with probability below e^-10000 is a broken sampler
MAX_WALL_S = 1e7  # ~4 months: longer is a broken clock, not an episode
MAX_REWARD = 1e6  # |reward|, |penalty|, cost, lambda: rewards live near [0, 1]


def _is_int_type(t: type) -> bool:
    return issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))


def _is_float_type(t: type) -> bool:
    return _is_int_type(t) or issubclass(t, (float, np.floating))


_KINDS = {int: ("an int", _is_int_type), float: ("a number", _is_float_type)}


def list_type_problem(values: list, inner: type) -> str | None:
    """None when every element of `values` is an `inner` (int: ints, not bools; float: ints or
    floats); else what the first other element is, with its index. One C-level pass."""
    kind, ok = _KINDS[inner]
    bad = [t for t in set(map(type, values)) if not ok(t)]
    if not bad:
        return None
    types = list(map(type, values))  # (error path only: where is the first one)
    i = min(types.index(t) for t in bad)
    return f"[{i}] is a {types[i].__name__} ({values[i]!r:.40}), expected {kind}"


def _where_int(values: list) -> int:
    """Index of the first element outside int64 (error path only)."""
    return next(i for i, v in enumerate(values) if not -INT64 <= v < INT64)


def int_array(where: str, name: str, values, lo: int, hi: int) -> np.ndarray:
    """`values` as int64, each an int in [lo, hi) (hi exclusive)."""
    if (p := list_type_problem(values, int)) is not None:
        raise EventError(f"{where}: {name}{p}")
    try:
        a = np.asarray(values, dtype=np.int64)
    except OverflowError:
        i = _where_int(values)
        raise EventError(f"{where}: {name}[{i}] = {values[i]} does not fit int64") from None
    out = (a < lo) | (a >= hi)
    if out.any():
        i = int(np.flatnonzero(out)[0])
        raise EventError(f"{where}: {name}[{i}] = {int(a[i])} is outside [{lo}, {hi})")
    return a


def float_array(where: str, name: str, values, lo: float = -math.inf, hi: float = math.inf) -> np.ndarray:
    """`values` as float64, each finite and in [lo, hi]."""
    if (p := list_type_problem(values, float)) is not None:
        raise EventError(f"{where}: {name}{p}")
    try:
        a = np.asarray(values, dtype=np.float64)
    except OverflowError:  # an int beyond float64 (10**400)
        i = next(i for i, v in enumerate(values) if abs(v) > 1e308)
        raise EventError(f"{where}: {name}[{i}] is not finite as a float") from None
    bad = ~np.isfinite(a)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise EventError(f"{where}: {name}[{i}] = {float(a[i])} is not finite")
    out = (a < lo) | (a > hi)
    if out.any():
        i = int(np.flatnonzero(out)[0])
        raise EventError(f"{where}: {name}[{i}] = {float(a[i])!r} is outside [{lo}, {hi}]")
    return a


def check_float(where: str, name: str, v, lo: float = -math.inf, hi: float = math.inf) -> float:
    """One number: an int or float, finite, in [lo, hi]."""
    if not _is_float_type(type(v)):
        raise EventError(f"{where}: {name} is a {type(v).__name__} ({v!r:.40}), expected a number")
    try:
        f = float(v)
    except OverflowError:
        raise EventError(f"{where}: {name} is not finite as a float") from None
    if not math.isfinite(f):
        raise EventError(f"{where}: {name} = {f} is not finite")
    if not lo <= f <= hi:
        raise EventError(f"{where}: {name} = {f!r} is outside [{lo}, {hi}]")
    return f


def check_int(where: str, name: str, v, lo: int, hi: int) -> int:
    """One int (not a bool) in [lo, hi) (hi exclusive)."""
    if not _is_int_type(type(v)):
        raise EventError(f"{where}: {name} is a {type(v).__name__} ({v!r:.40}), expected an int")
    if not lo <= v < hi:
        raise EventError(f"{where}: {name} = {v} is outside [{lo}, {hi})")
    return int(v)
