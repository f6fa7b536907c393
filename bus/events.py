"""Typed events that travel on the bus, encoded as msgpack with an explicit schema version.

Every body is a msgpack map ``{"schema": <the class's SCHEMA_VERSION>, "kind": <KIND>, **fields}``;
each event type has its own schema version and `decode` refuses any other.
`decode` validates kind, schema, required fields, field types and size limits and raises
`EventError` with a reason a person can act on; consumer loops park such messages in DLQ.

Large arrays (token ids, logprobs) travel as lists: msgpack packs small ints in 1 byte and
floats as float64, so float32 logprobs round-trip exactly.
"""
from __future__ import annotations

import dataclasses
import time
import types
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

SCHEMA = 1
ROLLOUT_SCHEMA = 2            # Rollout only: 2 added multi-turn episodes (loss mask, turns, tool calls)
MAX_TOKENS = 1 << 17          # longest sequence a Rollout may claim (absurd sizes are refused)
MAX_BODY = 64 * 1024 * 1024    # largest body decode accepts


class EventError(ValueError):
    """A body that is not a valid event: malformed msgpack, wrong schema, missing/wrong fields."""


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass(kw_only=True)
class Event:
    KIND: ClassVar[str] = "Event"
    SCHEMA_VERSION: ClassVar[int] = SCHEMA      # an event kind may move on alone (Rollout: ROLLOUT_SCHEMA)

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
    top_k: int = 0              # 0 = off
    max_tokens: int = 64
    n: int = 1                  # completions per task (group size)
    stop: list[int] = field(default_factory=list)   # stop token ids


@dataclass(kw_only=True)
class Task(Event):
    KIND: ClassVar[str] = "Task"
    task_id: str
    env: str
    prompt: str
    spec: dict = field(default_factory=dict)       # env-specific verification data (answer, tests)
    sampling: dict = field(default_factory=dict)   # SamplingParams as dict
    split: str = "train"                            # train | eval
    min_version: int = 0                            # sync mode: generate with at least this version
    created_at: float = field(default_factory=time.time)

    def msg_id(self) -> str:
        return f"task-{self.task_id}"


@dataclass(kw_only=True)
class Rollout(Event):
    """One completion, or one multi-turn episode, with everything the trainer needs to replay the
    sampler. An episode's `completion_ids` are every id after the prompt in order: the model's
    turns and the observations appended between them as tokens (never re-tokenised). Per token,
    `loss_mask` is 1 on model tokens and 0 on observation tokens, whose `logprobs` are 0.0, whose
    `token_versions` are -1 and whose sampling-mask rows keep the whole vocabulary."""
    KIND: ClassVar[str] = "Rollout"
    SCHEMA_VERSION: ClassVar[int] = ROLLOUT_SCHEMA
    rollout_id: str               # f"{task_id}-{sample_index}": stable across redeliveries
    task_id: str
    env: str
    sample_index: int
    group_size: int
    prompt: str
    spec: dict
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_text: str
    logprobs: list[float]          # behaviour logprob of each sampled token (truncated, renormalised)
    token_versions: list[int]      # policy version that produced each token (-1: observation token)
    sampling: dict                 # SamplingParams as dict
    sampling_mask: dict            # policy.sampling mask in wire form (rebuilds the kept set)
    quant: dict                    # policy quant config in wire form (sites replayed by the trainer)
    finish_reason: str             # stop | length | abort (an episode: its last turn's)
    cost_tokens: int               # model tokens (an episode: loss-mask ones)
    wall_s: float
    worker_id: str
    split: str = "train"
    epoch: int = 0                 # trainer epoch of the weights used
    loss_mask: list[int] = field(default_factory=list)   # per completion token; [] = all model tokens
    turns: int = 1                 # model turns (an episode's)
    tool_calls: int = 0            # commands run
    termination: str = ""          # an episode's termination reason (envs.episode.TERMINATIONS)
    episode: dict = field(default_factory=dict)   # envs.episode.EpisodeResult dict; {} for single-turn

    def msg_id(self) -> str:
        return f"rollout-{self.rollout_id}"

    def model_mask(self) -> list[int]:
        """1 per model token, 0 per observation token, over completion_ids."""
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.completion_ids)

    def validate(self) -> None:
        n = len(self.completion_ids)
        if n > MAX_TOKENS or len(self.prompt_ids) > MAX_TOKENS:
            raise EventError(f"Rollout {self.rollout_id}: absurd length ({len(self.prompt_ids)} prompt + "
                             f"{n} completion tokens, limit {MAX_TOKENS} each)")
        if len(self.logprobs) != n or len(self.token_versions) != n:
            raise EventError(f"Rollout {self.rollout_id}: logprobs/token_versions length "
                             f"{len(self.logprobs)}/{len(self.token_versions)} != {n} tokens")
        if not (0 <= self.cost_tokens <= MAX_TOKENS):
            raise EventError(f"Rollout {self.rollout_id}: absurd cost_tokens {self.cost_tokens}")
        if self.loss_mask:
            if len(self.loss_mask) != n:
                raise EventError(f"Rollout {self.rollout_id}: loss_mask length {len(self.loss_mask)} != {n} tokens")
            if any(m not in (0, 1) for m in self.loss_mask):
                raise EventError(f"Rollout {self.rollout_id}: loss_mask values must be 0 or 1")
            bad = [i for i, (m, v) in enumerate(zip(self.loss_mask, self.token_versions)) if (v < 0) != (m == 0)]
            if bad:
                raise EventError(f"Rollout {self.rollout_id}: token_versions must be -1 exactly on observation "
                                 f"tokens (loss_mask 0); first bad positions {bad[:5]}")
        elif any(v < 0 for v in self.token_versions):
            raise EventError(f"Rollout {self.rollout_id}: negative token_versions without a loss_mask")
        if not (1 <= self.turns <= MAX_TOKENS) or not (0 <= self.tool_calls <= MAX_TOKENS):
            raise EventError(f"Rollout {self.rollout_id}: absurd turns {self.turns} / tool_calls {self.tool_calls}")


@dataclass(kw_only=True)
class Scored(Event):
    KIND: ClassVar[str] = "Scored"
    rollout: dict                  # the Rollout, as its dict
    success: float                 # 0..1 (an episode: 1 iff all its tests pass)
    cost: float                    # cost units (generated tokens by default)
    lambda_: float                 # λ used
    penalty: float                 # λ·cost (+ overlong shaping)
    reward: float                  # success - penalty (an episode: fraction of tests passing - penalty)
    reason: str = ""               # verifier verdict / failure reason
    cost_wall_s: float = 0.0
    tool_calls: int = 0
    scorer_id: str = ""

    @property
    def task_id(self) -> str:      # for headers
        return self.rollout.get("task_id", "")

    def msg_id(self) -> str:
        return f"scored-{self.rollout.get('rollout_id')}"

    def get_rollout(self) -> Rollout:
        return typing.cast(Rollout, from_dict(self.rollout, Rollout))

    def validate(self) -> None:
        self.get_rollout()


@dataclass(kw_only=True)
class WeightEvent(Event):
    """What deltas and keyframes share. Schema 2: `epoch` (and the versions) are also inside the
    payload's signed container header; a reader refuses an event whose fields disagree with it."""
    SCHEMA_VERSION: ClassVar[int] = 2
    epoch: int                     # the publishing leader's lease revision
    codec: str
    size: int                      # payload bytes
    signature: bytes = b""         # ed25519 over the payload (which carries the signed header)
    payload: bytes | None = None   # inline when small
    blob: str = ""                 # object-store name otherwise
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
    model_config: dict             # policy.ModelConfig as dict

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
    parts: int                     # how many parts the manifest lists (one per trainer rank)
    part_bytes: int = 0            # their total size
    model_config: dict = field(default_factory=dict)   # policy.ModelConfig as dict
    changed_frac: float = 0.0

    @property
    def version(self) -> int:
        return self.to_version

    def msg_id(self) -> str:
        return f"manifest-e{self.epoch}-v{self.to_version}"

    def validate(self) -> None:
        if self.parts < 1 or self.part_bytes < 0 or self.to_version <= self.from_version:
            raise EventError(f"Manifest {self.msg_id()}: {self.parts} parts, {self.part_bytes} bytes, "
                             f"v{self.from_version}->v{self.to_version}")


@dataclass(kw_only=True)
class Heartbeat(Event):
    KIND: ClassVar[str] = "Heartbeat"
    component: str                 # trainer | rollout_worker | scorer
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


EVENTS: dict[str, type[Event]] = {c.KIND: c for c in (Task, Rollout, Scored, DeltaEvent, KeyframeEvent,
                                                          ManifestEvent, Heartbeat, Metrics)}


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
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and (inner is Any or all(_type_ok(v, inner) for v in value[:8]))
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
_UPGRADE = {("Rollout", 1): ": a rollout from a worker built before multi-turn episodes (no loss mask); "
                            "upgrade that worker",
            **{(kind, 1): " (an older build: its fields are not covered by the signature; upgrade the publisher)"
               for kind in ("Delta", "Keyframe")}}


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
        raise EventError(f"{cls.KIND}: unsupported schema version {schema!r} (this build speaks "
                         f"{cls.SCHEMA_VERSION}){_UPGRADE.get((cls.KIND, schema), '')}")
    hints = _HINTS.get(cls) or _HINTS.setdefault(cls, typing.get_type_hints(cls))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            if not _type_ok(v, hints[f.name]):
                raise EventError(f"{cls.KIND}: field {f.name!r} has type {type(v).__name__}, "
                                 f"expected {hints[f.name]}")
            kwargs[f.name] = v
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise EventError(f"{cls.KIND}: missing required field {f.name!r}")
    ev = cls(**kwargs)
    if hasattr(ev, "validate"):
        ev.validate()
    return ev


def decode(body: bytes, cls: type[Event] | None = None) -> Event:
    """Bytes → validated event. Raises EventError (never anything else) on bad input."""
    if len(body) > MAX_BODY:
        raise EventError(f"body of {len(body)} bytes exceeds {MAX_BODY}")
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several exception types
        raise EventError(f"malformed msgpack: {str(e) or type(e).__name__}") from None   # FormatError has no text
    try:
        return from_dict(d, cls)
    except EventError:
        raise
    except Exception as e:
        raise EventError(f"invalid {getattr(cls, 'KIND', 'event')}: {e}") from None
