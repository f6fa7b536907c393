"""Typed events that travel on the bus: msgspec Structs, encoded as msgpack with an explicit schema version.

Every body is a msgpack map ``{**fields, "schema": <the class's SCHEMA_VERSION>, "kind": <KIND>}``
(fields in declaration order; tests/test_events_wire.py holds bodies that must stay byte for byte);
each event type has its own schema version and `decode` refuses any other.
`decode` reads the body bounded (`unpack_bounded`), picks the class by kind, checks the schema,
then msgspec checks the fields against the declared schema: required fields, types (an int is not a
bool or a float), and every range declared with `Meta` on the field or on each list element (every
int fits int64; a Rollout's token ids in [0, 2**31), logprobs in [-1e4, 0], versions >= -1; its
wall_s, a Scored's rewards and costs, a λ bounded; every float finite: NaN and ±inf fail a bound).
What spans fields (a Rollout's list lengths, versions monotone, -1 exactly on observation tokens; a
Manifest's versions) is each kind's `_check`, vectorised with numpy. Failures raise `EventError`
naming the field and the index (`Rollout r-0: logprobs[3] = nan is not finite`); consumer
loops park such messages in DLQ. Token ids are checked against the vocabulary by the consumer that
knows it (the trainer: check_rollout). An event built in this process is checked by `validate`.

Large arrays (token ids, logprobs) travel as lists: msgpack packs small ints in 1 byte and
floats as float64, so float32 logprobs round-trip exactly.
"""

from __future__ import annotations

import math
import re
import sys
import time
import typing
import uuid
from typing import Annotated, Any, ClassVar

import msgpack
import msgspec
import numpy as np
from msgspec import Meta, Struct, field

from bus.errors import EventError

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
# bounds say what no healthy process sends: such values are a broken or hostile sender, and the
# trainer would turn them into NaN/inf weights downstream
INT64 = 1 << 63  # every int fits int64 (msgpack also carries uint64)
MAX_ID = 1 << 31  # token ids: [0, 2**31); the consumer that knows the vocabulary checks it
MAX_VERSION = 1 << 53  # policy versions (and epochs) far beyond any run
MIN_LOGPROB = -1e4  # a sampled token with probability below e^-10000 is a broken sampler
MAX_WALL_S = 1e7  # ~4 months: longer is a broken clock, not an episode
MAX_REWARD = 1e6  # |reward|, |penalty|, cost, lambda: rewards live near [0, 1]

Int64 = Annotated[int, Meta(ge=-INT64, le=INT64 - 1)]
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]  # NaN fails a bound
Count = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
Lambda = Annotated[float, Meta(ge=0.0, le=MAX_REWARD)]
Reward = Annotated[float, Meta(ge=-MAX_REWARD, le=MAX_REWARD)]
Unit = Annotated[float, Meta(ge=0.0, le=1.0)]
WallS = Annotated[float, Meta(ge=0.0, le=MAX_WALL_S)]
Cost = Annotated[float, Meta(ge=0.0, le=max(MAX_REWARD, MAX_WALL_S))]
Tokens = Annotated[list[Annotated[int, Meta(ge=0, lt=MAX_ID)]], Meta(max_length=MAX_TOKENS)]
Logprobs = Annotated[list[Annotated[float, Meta(ge=MIN_LOGPROB, le=0.0)]], Meta(max_length=MAX_TOKENS)]
Versions = Annotated[list[Annotated[int, Meta(ge=-1, lt=MAX_VERSION)]], Meta(max_length=MAX_TOKENS)]
Mask = Annotated[list[Annotated[int, Meta(ge=0, le=1)]], Meta(max_length=MAX_TOKENS)]


def new_id() -> str:
    return uuid.uuid4().hex


class Event(Struct, kw_only=True):
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
        d = msgspec.structs.asdict(self)
        d["schema"] = self.SCHEMA_VERSION  # after the fields: the wire order of every stored body
        d["kind"] = self.KIND
        return d

    def validate(self) -> None:
        """The checks `decode` makes, for an event built in this process (a Struct's constructor
        checks no types): EventError naming the field."""
        from_dict(msgspec.structs.asdict(self), type(self))

    def _check(self) -> None:
        """What spans fields, after msgspec checked each field (a kind overrides it)."""


class SamplingParams(Struct, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    n: int = 1  # completions per task (group size)
    stop: list[int] = []  # stop token ids


class Task(Event, kw_only=True):
    KIND: ClassVar[str] = "Task"
    task_id: str
    env: str
    prompt: str
    spec: dict = {}  # env-specific verification data (answer, tests)
    sampling: dict = {}  # SamplingParams as dict
    split: str = "train"  # train | eval
    min_version: Int64 = 0  # sync mode: generate with at least this version
    created_at: Finite = field(default_factory=time.time)
    # λ of the cost penalty, stamped at feed time: every member of the group is scored with it
    # (None: an older feeder's task, or none stamped; the scorer then uses its live KV value)
    lambda_: Lambda | None = None

    def msg_id(self) -> str:
        return f"task-{self.task_id}"


class Rollout(Event, kw_only=True):
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
    sample_index: Annotated[int, Meta(ge=0, lt=MAX_TOKENS)]
    group_size: Count  # 0: the trainer's default
    prompt: str
    spec: dict
    prompt_ids: Tokens
    completion_ids: Tokens
    completion_text: str
    logprobs: Logprobs  # behaviour logprob of each sampled token (truncated, renormalised)
    token_versions: Versions  # policy version that produced each token (-1: observation token)
    sampling: dict  # SamplingParams as dict
    sampling_mask: dict  # policy.sampling mask in wire form (rebuilds the kept set)
    quant: dict  # policy quant config in wire form (sites replayed by the trainer)
    finish_reason: str  # stop | length | abort (an episode: its last turn's)
    cost_tokens: Count  # model tokens (an episode: loss-mask ones)
    wall_s: WallS
    worker_id: str
    split: str = "train"
    epoch: Annotated[int, Meta(ge=0, lt=MAX_VERSION)] = 0  # trainer epoch of the weights used
    loss_mask: Mask = []  # per completion token; [] = all model tokens
    turns: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] = 1  # model turns (an episode's)
    tool_calls: Count = 0  # commands run
    termination: str = ""  # an episode's termination reason (envs.episode.TERMINATIONS)
    episode: dict = {}  # envs.episode.EpisodeResult dict; {} for single-turn
    lambda_: Lambda | None = None  # its task's λ (Task.lambda_); None: the scorer's live λ (older events)

    def msg_id(self) -> str:
        return f"rollout-{self.rollout_id}"

    def model_mask(self) -> list[int]:
        """1 per model token, 0 per observation token, over completion_ids."""
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.completion_ids)

    def _check(self) -> None:
        """Lengths agree; versions (each >= -1, msgspec) are -1 exactly on observation tokens and
        never decrease over the model's tokens. Vectorised over the whole lists."""
        where = f"Rollout {self.rollout_id}"
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.token_versions) != n:
            raise EventError(
                f"{where}: logprobs/token_versions length "
                f"{len(self.logprobs)}/{len(self.token_versions)} != {n} tokens"
            )
        versions = np.asarray(self.token_versions, dtype=np.int64)
        if self.loss_mask:
            if len(self.loss_mask) != n:
                raise EventError(f"{where}: loss_mask length {len(self.loss_mask)} != {n} tokens")
            model_token = np.asarray(self.loss_mask, dtype=np.int64) == 1
            bad = np.flatnonzero((versions >= 0) != model_token)
            if bad.size:
                raise EventError(
                    f"{where}: token_versions must be -1 exactly on observation "
                    f"tokens (loss_mask 0); first bad positions {bad[:5].tolist()}"
                )
            model = versions[model_token]  # observation tokens (-1) carry no version
        else:
            model = versions
            if model.size and model.min() < 0:
                raise EventError(
                    f"{where}: negative token_versions without a loss_mask "
                    f"(token_versions[{int(np.flatnonzero(versions < 0)[0])}])"
                )
        if model.size > 1 and (model[1:] < model[:-1]).any():  # (error path below)
            back = int(np.flatnonzero(model[1:] < model[:-1])[0])
            i = int(np.flatnonzero(versions >= 0)[back + 1])
            raise EventError(
                f"{where}: token_versions[{i}] = {int(versions[i])} goes back from "
                f"{int(model[back])}: versions must not decrease within a rollout"
            )


class Scored(Event, kw_only=True):
    KIND: ClassVar[str] = "Scored"
    rollout: dict  # the Rollout, as its dict (checked as one by _check)
    # the member's parts and its price (policy/reward.py): the trainer's penalty modes start from
    # the parts, the linear mode trains on `reward` as it is; all bounded (advantages are made of them)
    success: Unit  # 0..1 (an episode: 1 iff all its tests pass)
    cost: Cost  # cost units (generated tokens by default)
    lambda_: Lambda  # λ used (the group's)
    penalty: Reward  # λ·cost + shaping
    reward: Reward  # score - penalty
    reason: str = ""  # verifier verdict / failure reason
    cost_wall_s: WallS = 0.0
    tool_calls: Count = 0
    scorer_id: str = ""
    # an infrastructure failure ("sandbox", "workspace", "scoring_copy", "scorer_crash"): no verdict
    # on the policy; the trainer gives it weight 0 and leaves it out of its group's baseline. An
    # older scorer's event (without the field) decodes as "" (scored normally).
    infra: str = ""
    tampered: bool = False  # the verdict was judged forged (reward 0; counted by the scorer)
    # what the verifier or episode scored before any price (a completion: its success; an episode:
    # its share of passing tests, or its success) and the overlong shaping. An older scorer's event
    # carries neither (None): `unpriced` reads them from its price.
    score: Unit | None = None
    shaping: Reward | None = None

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

    def _check(self) -> None:
        try:
            self.get_rollout()
        except EventError as e:
            raise EventError(f"Scored {self.rollout.get('rollout_id')}: in its rollout: {e}") from None


class WeightEvent(Event, kw_only=True):
    """What deltas and keyframes share. Schema 2: `epoch` (and the versions) are also inside the
    payload's signed container header; a reader refuses an event whose fields disagree with it."""

    SCHEMA_VERSION: ClassVar[int] = 2
    epoch: Int64  # the publishing leader's lease revision
    codec: str
    size: Int64  # payload bytes
    signature: bytes = b""  # ed25519 over the payload (which carries the signed header)
    payload: bytes | None = None  # inline when small
    blob: str = ""  # object-store name otherwise
    trainer_id: str = ""


class DeltaEvent(WeightEvent, kw_only=True):
    """Announces policy version `to_version`; payload inline or in the object store."""

    KIND: ClassVar[str] = "Delta"
    from_version: Int64
    to_version: Int64
    base_digest: str
    new_digest: str
    changed_frac: Finite = 0.0

    @property
    def version(self) -> int:
        return self.to_version

    def msg_id(self) -> str:
        return f"delta-e{self.epoch}-v{self.to_version}"


class KeyframeEvent(WeightEvent, kw_only=True):
    """A full policy state `version`; model_config lets a worker build the model from it."""

    KIND: ClassVar[str] = "Keyframe"
    version: Int64
    digest: str
    model_config: dict  # policy.ModelConfig as dict

    def msg_id(self) -> str:
        return f"keyframe-e{self.epoch}-v{self.version}"


class ManifestEvent(WeightEvent, kw_only=True):
    """Announces policy version `to_version` published from shards: the payload is the signed
    manifest (delta_codec.sharded.Manifest: per-part sha256 and size, object-store names, epoch,
    trainer id, model config); the parts themselves are blobs. Schema 1: a kind of its own."""

    KIND: ClassVar[str] = "Manifest"
    SCHEMA_VERSION: ClassVar[int] = 1
    from_version: Int64
    to_version: Int64
    parts: Annotated[int, Meta(ge=1, le=INT64 - 1)]  # parts the manifest lists (one per trainer rank)
    part_bytes: Annotated[int, Meta(ge=0, le=INT64 - 1)] = 0  # their total size
    model_config: dict = {}  # policy.ModelConfig as dict
    changed_frac: Finite = 0.0

    @property
    def version(self) -> int:
        return self.to_version

    def msg_id(self) -> str:
        return f"manifest-e{self.epoch}-v{self.to_version}"

    def _check(self) -> None:
        if self.to_version <= self.from_version:
            raise EventError(
                f"Manifest {self.msg_id()}: v{self.from_version}->v{self.to_version} does not move on"
            )


class Heartbeat(Event, kw_only=True):
    KIND: ClassVar[str] = "Heartbeat"
    component: str  # trainer | rollout_worker | scorer
    component_id: str
    ts: Finite = field(default_factory=time.time)
    version: Int64 = -1
    metrics: dict = {}

    def msg_id(self) -> str:
        return f"hb-{self.component_id}-{self.ts:.6f}"


class Metrics(Event, kw_only=True):
    KIND: ClassVar[str] = "Metrics"
    component: str
    component_id: str
    step: Int64
    values: dict
    ts: Finite = field(default_factory=time.time)

    def msg_id(self) -> str:
        return f"metrics-{self.component_id}-{self.step}-{self.ts:.6f}"


EVENTS: dict[str, type[Event]] = {
    c.KIND: c for c in (Task, Rollout, Scored, DeltaEvent, KeyframeEvent, ManifestEvent, Heartbeat, Metrics)
}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, float):  # numpy float64 and other float subclasses: msgpack wrote them as floats
        return float(obj)
    raise NotImplementedError(f"cannot encode a {type(obj).__name__} in an event")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(ev: Event) -> bytes:
    return _ENCODER.encode(ev.to_dict())


_UPGRADE = {
    ("Rollout", 1): ": a rollout from a worker built before multi-turn episodes (no loss mask); "
    "upgrade that worker",
    **{
        (kind, 1): " (an older build: its fields are not covered by the signature; upgrade the publisher)"
        for kind in ("Delta", "Keyframe")
    },
}
_PATH = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_NOWHERE = object()


def _reason(label: str, kind: str, d: dict, err: msgspec.ValidationError) -> str:
    """msgspec's ``Expected `int` >= 0 - at `$.completion_ids[3]` `` as a reason naming the field,
    the index and the value that failed: `Rollout r-0: completion_ids[3] = -4 is outside its
    bounds (expected `int` >= 0)` (error path only)."""
    msg, _, at = str(err).partition(" - at `$")
    at = at.rstrip("`")
    if msg.startswith("Object missing required field"):
        name = msg.split("`")[1] if "`" in msg else msg
        return f"{kind}: missing required field {name!r}" + (f" in {at.lstrip('.')}" if at else "")
    value: Any = d
    try:
        for name, index in _PATH.findall(at):
            value = value[name] if name else value[int(index)]
    except (LookupError, TypeError, ValueError):
        value = _NOWHERE
    path = at.lstrip(".")
    why = msg[:1].lower() + msg[1:]
    if not path:
        return f"{label}: {why}"
    if value is _NOWHERE or isinstance(value, (list, dict)):
        return f"{label}: {path}: {why}"
    if ", got `" in why:  # the wrong type
        return f"{label}: {path} is a {type(value).__name__} ({value!r:.40}), {why.split(', got `')[0]}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{label}: {path} = {value} is not finite"
    return f"{label}: {path} = {value!r:.40} is outside its bounds ({why})"


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
    try:
        ev = msgspec.convert(d, cls)
    except msgspec.ValidationError as e:
        inner = d.get("rollout") if isinstance(d.get("rollout"), dict) else d  # (a Scored: its rollout's id)
        label = f"{cls.KIND} {str(inner.get('rollout_id') or d.get('task_id') or '')[:80]}".rstrip()
        raise EventError(_reason(label, cls.KIND, d, e)) from None
    try:
        ev._check()
    except EventError:
        raise
    except Exception as e:  # a check that met a value of a shape it did not expect: still bad input
        raise EventError(f"{cls.KIND}: invalid: {type(e).__name__}: {e}") from None
    return ev


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
