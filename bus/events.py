"""Typed events that travel on the bus, encoded as msgpack with an explicit schema version.

Every body is a msgpack map ``{"schema": <the class's SCHEMA_VERSION>, "kind": <KIND>, **fields}``;
each event type has its own schema version and `decode` refuses any other.
`decode` validates kind, schema, required fields, field types and size limits and raises
`EventError` with a reason a person can act on; consumer loops park such messages in DLQ.
Every number is checked, whole lists included (vectorised, `validation.py`): every element of a
list has its declared type, every float field is finite, every int fits int64, and each kind's
`validate` adds its ranges (a Rollout's logprobs finite and <= 0, token ids >= 0, versions
monotone, wall_s finite and >= 0; a Scored's rewards and costs finite and bounded, its score in
[0, 1]; a Task's and a Rollout's λ, where stamped, finite and >= 0). A reason names the field
and the index (`Rollout r-0: logprobs[3] = nan is not finite`). Token ids are checked against the
vocabulary by the consumer that knows it (the trainer: check_rollout).

Large arrays (token ids, logprobs) travel as lists: msgpack packs small ints in 1 byte and
floats as float64, so float32 logprobs round-trip exactly.
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from bus.errors import EventError
from bus.validation import (
    INT64,
    MAX_ID,
    MAX_REWARD,
    MAX_VERSION,
    MAX_WALL_S,
    MIN_LOGPROB,
    check_float,
    check_int,
    float_array,
    int_array,
    list_type_problem,
)

SCHEMA = 1
ROLLOUT_SCHEMA = 2  # Rollout only: 2 added multi-turn episodes (loss mask, turns, tool calls)
MAX_TOKENS = 1 << 17  # longest sequence a Rollout may claim (absurd sizes are refused)
MAX_BODY = 64 * 1024 * 1024  # largest body decode accepts
# what one body may make decode build (unpack_bounded): items of one array (token lists, with room),
# pairs of one map, and maps + arrays in all
MAX_ARRAY = 2 * MAX_TOKENS
MAX_MAP = 1 << 16
MAX_CONTAINERS_FLOOR = 4096
BYTES_PER_CONTAINER = 64


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass(kw_only=True)
class Event:
    KIND: ClassVar[str] = "Event"
    SCHEMA_VERSION: ClassVar[int] = SCHEMA  # an event kind may move on alone (Rollout: ROLLOUT_SCHEMA)

    def msg_id(self) -> str:
        """Deduplication id (Nats-Msg-Id). Deterministic per logical message."""
        raise NotImplementedError

    def headers(self) -> dict[str, str]:
        """Human-readable NATS headers (besides Nats-Msg-Id, which the publisher adds)."""
        h = {"Rl-Schema": str(self.SCHEMA_VERSION), "Rl-Kind": self.KIND}
        v = getattr(self, "version", None)
        if v is None:
            v = getattr(self, "to_version", None)
        if v is not None:
            h["Rl-Version"] = str(v)
        t = getattr(self, "task_id", None)
        if t:
            h["Rl-Task"] = str(t)
        return h

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["schema"] = self.SCHEMA_VERSION
        d["kind"] = self.KIND
        return d


@dataclass(kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    n: int = 1  # completions per task (group size)
    stop: list[int] = field(default_factory=list)  # stop token ids


@dataclass(kw_only=True)
class Task(Event):
    KIND: ClassVar[str] = "Task"
    task_id: str
    env: str
    prompt: str
    spec: dict = field(default_factory=dict)  # env-specific verification data (answer, tests)
    sampling: dict = field(default_factory=dict)  # SamplingParams as dict
    split: str = "train"  # train | eval
    min_version: int = 0  # sync mode: generate with at least this version
    created_at: float = field(default_factory=time.time)
    # λ of the cost penalty, stamped at feed time: every member of the group is scored with it
    # (None: an older feeder's task, or none stamped; the scorer then uses its live KV value)
    lambda_: float | None = None

    def msg_id(self) -> str:
        return f"task-{self.task_id}"

    def validate(self) -> None:
        if self.lambda_ is not None:
            check_float(f"Task {self.task_id}", "lambda_", self.lambda_, 0.0, MAX_REWARD)


@dataclass(kw_only=True)
class Rollout(Event):
    """One completion, or one multi-turn episode, with everything the trainer needs to replay the
    sampler. An episode's `completion_ids` are every id after the prompt in order: the model's
    turns and the observations appended between them as tokens (never re-tokenised). Per token,
    `loss_mask` is 1 on model tokens and 0 on observation tokens, whose `logprobs` are 0.0, whose
    `token_versions` are -1 and whose sampling-mask rows keep the whole vocabulary."""

    KIND: ClassVar[str] = "Rollout"
    SCHEMA_VERSION: ClassVar[int] = ROLLOUT_SCHEMA
    rollout_id: str  # f"{task_id}-{sample_index}": stable across redeliveries
    task_id: str
    env: str
    sample_index: int
    group_size: int
    prompt: str
    spec: dict
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_text: str
    logprobs: list[float]  # behaviour logprob of each sampled token (truncated, renormalised)
    token_versions: list[int]  # policy version that produced each token (-1: observation token)
    sampling: dict  # SamplingParams as dict
    sampling_mask: dict  # policy.sampling mask in wire form (rebuilds the kept set)
    quant: dict  # policy quant config in wire form (sites replayed by the trainer)
    finish_reason: str  # stop | length | abort (an episode: its last turn's)
    cost_tokens: int  # model tokens (an episode: loss-mask ones)
    wall_s: float
    worker_id: str
    split: str = "train"
    epoch: int = 0  # trainer epoch of the weights used
    loss_mask: list[int] = field(default_factory=list)  # per completion token; [] = all model tokens
    turns: int = 1  # model turns (an episode's)
    tool_calls: int = 0  # commands run
    termination: str = ""  # an episode's termination reason (envs.episode.TERMINATIONS)
    episode: dict = field(default_factory=dict)  # envs.episode.EpisodeResult dict; {} for single-turn
    lambda_: float | None = None  # its task's λ (Task.lambda_); None: the scorer's live λ (older events)

    def msg_id(self) -> str:
        return f"rollout-{self.rollout_id}"

    def model_mask(self) -> list[int]:
        """1 per model token, 0 per observation token, over completion_ids."""
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.completion_ids)

    def validate(self) -> None:
        """Every number, whole lists (vectorised: bus/validation.py); EventError names field and index."""
        where = f"Rollout {self.rollout_id}"
        n = len(self.completion_ids)
        if n > MAX_TOKENS or len(self.prompt_ids) > MAX_TOKENS:
            raise EventError(
                f"{where}: absurd length ({len(self.prompt_ids)} prompt + "
                f"{n} completion tokens, limit {MAX_TOKENS} each)"
            )
        if len(self.logprobs) != n or len(self.token_versions) != n:
            raise EventError(
                f"{where}: logprobs/token_versions length "
                f"{len(self.logprobs)}/{len(self.token_versions)} != {n} tokens"
            )
        check_int(where, "cost_tokens", self.cost_tokens, 0, MAX_TOKENS + 1)
        if not (1 <= self.turns <= MAX_TOKENS) or not (0 <= self.tool_calls <= MAX_TOKENS):
            raise EventError(f"{where}: absurd turns {self.turns} / tool_calls {self.tool_calls}")
        check_int(where, "sample_index", self.sample_index, 0, MAX_TOKENS)
        check_int(where, "group_size", self.group_size, 0, MAX_TOKENS + 1)  # 0: the trainer's default
        check_int(where, "epoch", self.epoch, 0, MAX_VERSION)
        check_float(where, "wall_s", self.wall_s, 0.0, MAX_WALL_S)
        if self.lambda_ is not None:
            check_float(where, "lambda_", self.lambda_, 0.0, MAX_REWARD)
        int_array(where, "prompt_ids", self.prompt_ids, 0, MAX_ID)
        int_array(where, "completion_ids", self.completion_ids, 0, MAX_ID)
        float_array(where, "logprobs", self.logprobs, MIN_LOGPROB, 0.0)
        versions = int_array(where, "token_versions", self.token_versions, -1, MAX_VERSION)
        if self.loss_mask:
            if len(self.loss_mask) != n:
                raise EventError(f"{where}: loss_mask length {len(self.loss_mask)} != {n} tokens")
            try:
                mask = int_array(where, "loss_mask", self.loss_mask, 0, 2)
            except EventError as e:
                raise EventError(f"{e}: loss_mask values must be 0 or 1") from None
            bad = np.flatnonzero((versions < 0) != (mask == 0))
            if bad.size:
                raise EventError(
                    f"{where}: token_versions must be -1 exactly on observation "
                    f"tokens (loss_mask 0); first bad positions {bad[:5].tolist()}"
                )
        elif (versions < 0).any():
            raise EventError(
                f"{where}: negative token_versions without a loss_mask "
                f"(token_versions[{int(np.flatnonzero(versions < 0)[0])}])"
            )
        model = versions[versions >= 0]  # observation tokens (-1) carry no version
        if model.size > 1 and (back := np.flatnonzero(np.diff(model) < 0)).size:
            i = int(np.flatnonzero(versions >= 0)[back[0] + 1])
            raise EventError(
                f"{where}: token_versions[{i}] = {int(versions[i])} goes back from "
                f"{int(model[back[0]])}: versions must not decrease within a rollout"
            )


@dataclass(kw_only=True)
class Scored(Event):
    KIND: ClassVar[str] = "Scored"
    rollout: dict  # the Rollout, as its dict
    # the member's parts and its price (policy/reward.py): the trainer's penalty modes start from
    # the parts, the linear mode trains on `reward` as it is
    success: float  # 0..1 (an episode: 1 iff all its tests pass)
    cost: float  # cost units (generated tokens by default)
    lambda_: float  # λ used (the group's)
    penalty: float  # λ·cost + shaping
    reward: float  # score - penalty
    reason: str = ""  # verifier verdict / failure reason
    cost_wall_s: float = 0.0
    tool_calls: int = 0
    scorer_id: str = ""
    # an infrastructure failure ("sandbox", "workspace", "scoring_copy", "scorer_crash"): no verdict
    # on the policy; the trainer gives it weight 0 and leaves it out of its group's baseline. An
    # older scorer's event (without the field) decodes as "" (scored normally).
    infra: str = ""
    tampered: bool = False  # the verdict was judged forged (reward 0; counted by the scorer)
    # what the verifier or episode scored before any price (a completion: its success; an episode:
    # its share of passing tests, or its success) and the overlong shaping. An older scorer's event
    # carries neither (None): `unpriced` reads them from its price.
    score: float | None = None
    shaping: float | None = None

    @property
    def task_id(self) -> str:  # for headers
        return self.rollout.get("task_id", "")

    def msg_id(self) -> str:
        return f"scored-{self.rollout.get('rollout_id')}"

    def get_rollout(self) -> Rollout:
        return typing.cast(Rollout, from_dict(self.rollout, Rollout))

    def unpriced(self) -> tuple[float, float]:
        """(score, shaping) of this member. An older scorer's event carried only its price
        (reward = score - penalty, penalty = λ·cost + shaping): its parts are read back from it."""
        if self.score is not None and self.shaping is not None:
            return self.score, self.shaping
        return self.reward + self.penalty, self.penalty - self.lambda_ * self.cost

    def validate(self) -> None:
        """The scores finite and bounded (the trainer's advantages are made of them), then the rollout."""
        where = f"Scored {self.rollout.get('rollout_id') if isinstance(self.rollout, dict) else '?'}"
        check_float(where, "success", self.success, 0.0, 1.0)
        check_float(where, "cost", self.cost, 0.0, max(MAX_REWARD, MAX_WALL_S))
        check_float(where, "lambda_", self.lambda_, 0.0, MAX_REWARD)
        check_float(where, "penalty", self.penalty, -MAX_REWARD, MAX_REWARD)
        check_float(where, "reward", self.reward, -MAX_REWARD, MAX_REWARD)
        if self.score is not None:
            check_float(where, "score", self.score, 0.0, 1.0)
        if self.shaping is not None:
            check_float(where, "shaping", self.shaping, -MAX_REWARD, MAX_REWARD)
        check_float(where, "cost_wall_s", self.cost_wall_s, 0.0, MAX_WALL_S)
        check_int(where, "tool_calls", self.tool_calls, 0, MAX_TOKENS + 1)
        try:
            self.get_rollout()
        except EventError as e:
            raise EventError(f"{where}: in its rollout: {e}") from None


@dataclass(kw_only=True)
class WeightEvent(Event):
    """What deltas and keyframes share. Schema 2: `epoch` (and the versions) are also inside the
    payload's signed container header; a reader refuses an event whose fields disagree with it."""

    SCHEMA_VERSION: ClassVar[int] = 2
    epoch: int  # the publishing leader's lease revision
    codec: str
    size: int  # payload bytes
    signature: bytes = b""  # ed25519 over the payload (which carries the signed header)
    payload: bytes | None = None  # inline when small
    blob: str = ""  # object-store name otherwise
    trainer_id: str = ""


@dataclass(kw_only=True)
class DeltaEvent(WeightEvent):
    """Announces policy version `to_version`; payload inline or in the object store."""

    KIND: ClassVar[str] = "Delta"
    from_version: int
    to_version: int
    base_digest: str
    new_digest: str
    changed_frac: float = 0.0

    @property
    def version(self) -> int:
        return self.to_version

    def msg_id(self) -> str:
        return f"delta-e{self.epoch}-v{self.to_version}"


@dataclass(kw_only=True)
class KeyframeEvent(WeightEvent):
    """A full policy state `version`; model_config lets a worker build the model from it."""

    KIND: ClassVar[str] = "Keyframe"
    version: int
    digest: str
    model_config: dict  # policy.ModelConfig as dict

    def msg_id(self) -> str:
        return f"keyframe-e{self.epoch}-v{self.version}"


@dataclass(kw_only=True)
class ManifestEvent(WeightEvent):
    """Announces policy version `to_version` published from shards: the payload is the signed
    manifest (delta_codec.sharded.Manifest: per-part sha256 and size, object-store names, epoch,
    trainer id, model config); the parts themselves are blobs. Schema 1: a kind of its own."""

    KIND: ClassVar[str] = "Manifest"
    SCHEMA_VERSION: ClassVar[int] = 1
    from_version: int
    to_version: int
    parts: int  # how many parts the manifest lists (one per trainer rank)
    part_bytes: int = 0  # their total size
    model_config: dict = field(default_factory=dict)  # policy.ModelConfig as dict
    changed_frac: float = 0.0

    @property
    def version(self) -> int:
        return self.to_version

    def msg_id(self) -> str:
        return f"manifest-e{self.epoch}-v{self.to_version}"

    def validate(self) -> None:
        if self.parts < 1 or self.part_bytes < 0 or self.to_version <= self.from_version:
            raise EventError(
                f"Manifest {self.msg_id()}: {self.parts} parts, {self.part_bytes} bytes, "
                f"v{self.from_version}->v{self.to_version}"
            )


@dataclass(kw_only=True)
class Heartbeat(Event):
    KIND: ClassVar[str] = "Heartbeat"
    component: str  # trainer | rollout_worker | scorer
    component_id: str
    ts: float = field(default_factory=time.time)
    version: int = -1
    metrics: dict = field(default_factory=dict)

    def msg_id(self) -> str:
        return f"hb-{self.component_id}-{self.ts:.6f}"


@dataclass(kw_only=True)
class Metrics(Event):
    KIND: ClassVar[str] = "Metrics"
    component: str
    component_id: str
    step: int
    values: dict
    ts: float = field(default_factory=time.time)

    def msg_id(self) -> str:
        return f"metrics-{self.component_id}-{self.step}-{self.ts:.6f}"


EVENTS: dict[str, type[Event]] = {
    c.KIND: c for c in (Task, Rollout, Scored, DeltaEvent, KeyframeEvent, ManifestEvent, Heartbeat, Metrics)
}


def encode(ev: Event) -> bytes:
    return msgpack.packb(ev.to_dict(), use_bin_type=True)


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:  # the elements: from_dict checks every one (list_type_problem)
        return isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


_HINTS: dict[type, dict[str, Any]] = {}
_UPGRADE = {
    ("Rollout", 1): ": a rollout from a worker built before multi-turn episodes (no loss mask); "
    "upgrade that worker",
    **{
        (kind, 1): " (an older build: its fields are not covered by the signature; upgrade the publisher)"
        for kind in ("Delta", "Keyframe")
    },
}


def from_dict(d: dict, cls: type[Event] | None = None) -> Event:
    if not isinstance(d, dict):
        raise EventError(f"body is a {type(d).__name__}, not a map")
    kind = d.get("kind")
    if cls is None:
        if kind not in EVENTS:
            raise EventError(f"unknown event kind {kind!r}")
        cls = EVENTS[kind]
    elif kind is not None and kind != cls.KIND:
        raise EventError(f"expected a {cls.KIND} event, got kind {kind!r}")
    schema = d.get("schema", cls.SCHEMA_VERSION)
    if schema != cls.SCHEMA_VERSION:
        raise EventError(
            f"{cls.KIND}: unsupported schema version {schema!r} (this build speaks "
            f"{cls.SCHEMA_VERSION}){_UPGRADE.get((cls.KIND, schema), '')}"
        )
    hints = _HINTS.get(cls) or _HINTS.setdefault(cls, typing.get_type_hints(cls))
    kwargs = {}
    inner = d.get("rollout") if isinstance(d.get("rollout"), dict) else d  # (a Scored: its rollout's id)
    label = f"{cls.KIND} {str(inner.get('rollout_id') or d.get('task_id') or '')[:80]}".rstrip()
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            tp = hints[f.name]
            if not _type_ok(v, tp):
                raise EventError(f"{label}: field {f.name!r} has type {type(v).__name__}, expected {tp}")
            _check_value(label, f.name, v, tp)
            kwargs[f.name] = v
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise EventError(f"{cls.KIND}: missing required field {f.name!r}")
    ev = cls(**kwargs)
    if hasattr(ev, "validate"):
        try:
            ev.validate()
        except EventError:
            raise
        except Exception as e:  # a check that met a value of a shape it did not expect: still bad input
            raise EventError(f"{cls.KIND}: invalid: {type(e).__name__}: {e}") from None
    return ev


def _check_value(kind: str, name: str, v: Any, tp: Any) -> None:
    """Whatever the kind: every element of a typed list has its type, a float is finite, an
    int fits int64 (the kind's `validate` then checks its ranges)."""
    if typing.get_origin(tp) is list:
        inner = (typing.get_args(tp) or (Any,))[0]
        if inner in (int, float) and (p := list_type_problem(v, inner)) is not None:
            raise EventError(f"{kind}: field {name}{p}")
    elif tp is float and not math.isfinite(v):
        raise EventError(f"{kind}: field {name!r} = {v} is not finite")
    elif tp is int and not -INT64 <= v < INT64:
        raise EventError(f"{kind}: field {name!r} = {v} does not fit int64")


def unpack_bounded(body: bytes):
    """msgpack → Python, refused before it allocates much more than the body: every length is
    checked against its header before the object is built (no array of more than MAX_ARRAY items,
    no map of more than MAX_MAP pairs, no string or bytes longer than the body), and maps and arrays
    together number at most MAX_CONTAINERS_FLOOR + len(body) // BYTES_PER_CONTAINER (an empty map
    is 1 byte on the wire and ~70 as a dict: 8 MiB of them would be ~600 MB). Nesting is bounded by
    msgpack's own stack. A legitimate event holds a few dozen containers and its large arrays are
    token lists (<= MAX_TOKENS each)."""
    left = MAX_CONTAINERS_FLOOR + len(body) // BYTES_PER_CONTAINER

    def count(obj):
        nonlocal left
        left -= 1
        if left < 0:
            raise EventError(
                f"more than {MAX_CONTAINERS_FLOOR + len(body) // BYTES_PER_CONTAINER} maps and "
                f"arrays in a body of {len(body)} bytes"
            )
        return obj

    n = len(body)
    return msgpack.unpackb(
        body,
        raw=False,
        strict_map_key=False,
        max_str_len=n,
        max_bin_len=n,
        max_ext_len=n,
        max_array_len=min(n, MAX_ARRAY),
        max_map_len=min(n, MAX_MAP),
        object_hook=count,
        list_hook=count,
    )


def decode(body: bytes, cls: type[Event] | None = None) -> Event:
    """Bytes → validated event. Raises EventError (never anything else) on bad input."""
    if len(body) > MAX_BODY:
        raise EventError(f"body of {len(body)} bytes exceeds {MAX_BODY}")
    try:
        d = unpack_bounded(body)
    except EventError:
        raise
    except Exception as e:  # msgpack raises several exception types
        raise EventError(
            f"malformed msgpack: {str(e) or type(e).__name__}"
        ) from None  # FormatError has no text
    try:
        return from_dict(d, cls)
    except EventError:
        raise
    except Exception as e:
        raise EventError(f"invalid {getattr(cls, 'KIND', 'event')}: {e}") from None
