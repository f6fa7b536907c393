"""The one place that names the JetStream topology (see shared/DESIGN.md).

Provisioning (`provision`) is idempotent: it creates what is missing and updates what
changed. Names here are the contract between processes.
"""

from __future__ import annotations

# streams
TASKS = "TASKS"
ROLLOUTS = "ROLLOUTS"
SCORED = "SCORED"
WEIGHTS = "WEIGHTS"
DLQ = "DLQ"
TELEMETRY = "TELEMETRY"  # heartbeats + metrics (limits retention), for `asyncrl inspect` and `up`


# subjects
def task_subject(env: str) -> str:
    return f"rl.tasks.{env}"


def rollout_subject(env: str) -> str:
    return f"rl.rollouts.{env}"


def scored_subject(env: str) -> str:
    return f"rl.scored.{env}"


def dlq_subject(stream: str) -> str:
    return f"rl.dlq.{stream}"


def heartbeat_subject(component: str, cid: str) -> str:
    return f"rl.heartbeat.{component}.{cid}"


def metrics_subject(component: str, cid: str) -> str:
    return f"rl.metrics.{component}.{cid}"


DELTA_SUBJECT = "rl.weights.delta"
KEYFRAME_SUBJECT = "rl.weights.keyframe"
MANIFEST_SUBJECT = "rl.weights.manifest"  # a version published from shards (bus/weights/manifest.py)

# durable consumers
ROLLOUT_CONSUMER = "rollout"  # on TASKS, shared by all workers
SCORER_CONSUMER = "scorer"  # on ROLLOUTS, shared by all scorers
TRAINER_CONSUMER = "trainer"  # on SCORED, leader fetches

# KV bucket and keys; object store
CONTROL_BUCKET = "rl-control"
KEY_VERSION = "version"
KEY_LEADER = "leader"
KEY_LAMBDA = "lambda"
KEY_CONFIG = "config"
BLOB_BUCKET = "rl-blobs"


def api_prefix(domain: str | None = None) -> str:
    """The JetStream API subject prefix for a domain (what nats-py's JetStreamContext uses)."""
    return f"$JS.{domain}.API" if domain else "$JS.API"


# ---------------------------------------------------------------------------------------------
# provisioning: one declaration of every stream / consumer / bucket, applied idempotently
# ---------------------------------------------------------------------------------------------
import dataclasses  # noqa: E402  (kept below the names: the names are the contract, this is the how)
from typing import Annotated, Literal  # noqa: E402

from nats.js import api  # noqa: E402
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError  # noqa: E402
from pydantic import Field  # noqa: E402
from tenacity import (  # noqa: E402
    AsyncRetrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from kernel.config import config_class  # noqa: E402

# "no suitable peers for placement": a forming cluster refuses a replicated stream for a few seconds
# even after its meta leader lists every peer current (its placement reads peer state of its own)
PLACEMENT_REFUSED = 10005
PLACEMENT_WAIT_S = 30.0


def _placement_refused(e: BaseException) -> bool:
    return isinstance(e, BadRequestError) and e.err_code == PLACEMENT_REFUSED


async def _create(make):
    """`make()` (a stream or bucket creation), retried while the cluster refuses placement only;
    every other error, and a refusal that outlasts PLACEMENT_WAIT_S, is raised as it came."""
    async for attempt in AsyncRetrying(
        retry=retry_if_exception(_placement_refused),
        stop=stop_after_delay(PLACEMENT_WAIT_S),
        wait=wait_exponential(multiplier=0.2, max=2.0),
        reraise=True,
    ):
        with attempt:
            return await make()


WORK_STREAMS = {TASKS: "rl.tasks.>", ROLLOUTS: "rl.rollouts.>", SCORED: "rl.scored.>"}
WORK_CONSUMERS = {TASKS: ROLLOUT_CONSUMER, ROLLOUTS: SCORER_CONSUMER, SCORED: TRAINER_CONSUMER}


@config_class
class TopologyConfig:
    replicas: Annotated[int, Field(ge=1, description="3 on a JetStream cluster")] = 1
    storage: Literal["file", "memory"] = "file"
    max_age_s: Annotated[
        float, Field(description="work streams: unconsumed work older than this is dropped")
    ] = 7 * 86400
    duplicate_window_s: Annotated[float, Field(description="Nats-Msg-Id dedupe horizon")] = 120.0
    weights_keep: Annotated[
        int, Field(ge=1, description="WEIGHTS keeps the last N messages per subject (deltas, keyframes)")
    ] = 64
    dlq_max_age_s: float = 30 * 86400
    telemetry_max_age_s: float = 3600.0
    ack_wait_s: Annotated[
        float, Field(gt=0, description="handlers send in_progress every ack_wait/3, so this can stay short")
    ] = 30.0
    max_deliver: Annotated[
        int, Field(ge=1, description="then the consumer loop parks the message in DLQ")
    ] = 5
    max_ack_pending: Annotated[int, Field(ge=1)] = 1024
    kv_history: Annotated[int, Field(ge=1)] = 5
    blob_ttl_s: float = 86400.0
    max_msg_size: Annotated[int, Field(description="-1: the server's max_payload")] = -1


def stream_configs(cfg: TopologyConfig) -> list[api.StreamConfig]:
    storage = api.StorageType.FILE if cfg.storage == "file" else api.StorageType.MEMORY
    common = dict(
        num_replicas=cfg.replicas,
        storage=storage,
        max_msg_size=cfg.max_msg_size,
        duplicate_window=cfg.duplicate_window_s,
    )
    out = [
        api.StreamConfig(
            name=s, subjects=[subj], retention=api.RetentionPolicy.WORK_QUEUE, max_age=cfg.max_age_s, **common
        )
        for s, subj in WORK_STREAMS.items()
    ]
    out.append(
        api.StreamConfig(
            name=WEIGHTS,
            subjects=[DELTA_SUBJECT, KEYFRAME_SUBJECT, MANIFEST_SUBJECT],
            retention=api.RetentionPolicy.LIMITS,
            max_msgs_per_subject=cfg.weights_keep,
            **common,
        )
    )
    out.append(
        api.StreamConfig(
            name=DLQ,
            subjects=["rl.dlq.>"],
            retention=api.RetentionPolicy.LIMITS,
            max_age=cfg.dlq_max_age_s,
            **common,
        )
    )
    out.append(
        api.StreamConfig(
            name=TELEMETRY,
            subjects=["rl.heartbeat.>", "rl.metrics.>"],
            retention=api.RetentionPolicy.LIMITS,
            max_age=cfg.telemetry_max_age_s,
            **{**common, "duplicate_window": min(cfg.duplicate_window_s, cfg.telemetry_max_age_s)},
        )
    )
    return out


def consumer_config(cfg: TopologyConfig, durable: str) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        name=durable,
        durable_name=durable,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=cfg.ack_wait_s,
        max_deliver=cfg.max_deliver,
        max_ack_pending=cfg.max_ack_pending,
        num_replicas=cfg.replicas if cfg.replicas > 1 else None,
    )


# the fields we declare; the server fills in the rest, so only these are compared
_STREAM_FIELDS = (
    "subjects",
    "max_age",
    "max_msgs_per_subject",
    "duplicate_window",
    "num_replicas",
    "max_msg_size",
    "retention",
    "storage",
)
_CONSUMER_FIELDS = ("ack_wait", "max_deliver", "max_ack_pending", "ack_policy")


def _differs(want, have, fields) -> list[str]:
    out = []
    for f in fields:
        w, h = getattr(want, f), getattr(have, f)
        if w is None:
            continue
        if isinstance(w, float) or isinstance(h, float):
            if abs(float(w) - float(h or 0)) > 1e-6:
                out.append(f)
        elif w != h:
            out.append(f)
    return out


async def provision(js, cfg: TopologyConfig | None = None, log=None) -> dict[str, str]:
    """Create what is missing, update what changed. Returns {name: created|updated|unchanged}."""
    cfg = cfg or TopologyConfig()
    done: dict[str, str] = {}
    for want in stream_configs(cfg):
        try:
            have = (await js.stream_info(want.name)).config
        except NotFoundError:
            await _create(lambda w=want: js.add_stream(w))
            done[want.name] = "created"
            continue
        changed = _differs(want, have, _STREAM_FIELDS)
        if not changed:
            done[want.name] = "unchanged"
            continue
        if {"retention", "storage"} & set(changed):
            raise ValueError(
                f"stream {want.name}: cannot change {changed} in place "
                f"(have retention={have.retention} storage={have.storage}); "
                f"migrate the stream by hand"
            )
        merged = dataclasses.replace(have, **{f: getattr(want, f) for f in changed})
        await js.update_stream(merged)
        done[want.name] = "updated"
        if log:
            log.info("stream updated", stream=want.name, fields=changed)

    for stream, durable in WORK_CONSUMERS.items():
        want = consumer_config(cfg, durable)
        try:
            have = (await js.consumer_info(stream, durable)).config
        except NotFoundError:
            await js.add_consumer(stream, want)
            done[f"{stream}/{durable}"] = "created"
            continue
        changed = _differs(want, have, _CONSUMER_FIELDS)
        if not changed:
            done[f"{stream}/{durable}"] = "unchanged"
            continue
        # the consumer CREATE api updates a durable in place when only mutable fields differ;
        # verify, since older clients/servers silently keep the old config
        await js.add_consumer(stream, want)
        have = (await js.consumer_info(stream, durable)).config
        if _differs(want, have, _CONSUMER_FIELDS):
            # last resort: recreate. Work-queue messages stay in the stream; unacked ones are redelivered.
            await js.delete_consumer(stream, durable)
            await js.add_consumer(stream, want)
        done[f"{stream}/{durable}"] = "updated"
        if log:
            log.info("consumer updated", stream=stream, consumer=durable, fields=changed)

    storage = api.StorageType.FILE if cfg.storage == "file" else api.StorageType.MEMORY
    try:
        await js.key_value(CONTROL_BUCKET)
        info = await js.stream_info(f"KV_{CONTROL_BUCKET}")
        if info.config.max_msgs_per_subject != cfg.kv_history:
            await js.update_stream(dataclasses.replace(info.config, max_msgs_per_subject=cfg.kv_history))
            done[CONTROL_BUCKET] = "updated"
        else:
            done[CONTROL_BUCKET] = "unchanged"
    except BucketNotFoundError:
        kv = api.KeyValueConfig(
            bucket=CONTROL_BUCKET, history=cfg.kv_history, replicas=cfg.replicas, storage=storage
        )
        await _create(lambda: js.create_key_value(kv))
        done[CONTROL_BUCKET] = "created"

    try:
        await js.object_store(BLOB_BUCKET)
        info = await js.stream_info(f"OBJ_{BLOB_BUCKET}")
        if abs((info.config.max_age or 0) - cfg.blob_ttl_s) > 1e-6:
            await js.update_stream(dataclasses.replace(info.config, max_age=cfg.blob_ttl_s))
            done[BLOB_BUCKET] = "updated"
        else:
            done[BLOB_BUCKET] = "unchanged"
    except (BucketNotFoundError, NotFoundError):
        blobs = api.ObjectStoreConfig(
            bucket=BLOB_BUCKET, ttl=cfg.blob_ttl_s, replicas=cfg.replicas, storage=storage
        )
        await _create(lambda: js.create_object_store(BLOB_BUCKET, config=blobs))
        done[BLOB_BUCKET] = "created"
    return done


# ---------------------------------------------------------------------------------------------
# regions: a region's server (its own JetStream domain, a leaf node of the hub) mirrors WEIGHTS
# and the blob store's stream under the same names, so the weight feed and the blob reader run
# unchanged against the region's domain, and each update crosses the WAN once per region
# ---------------------------------------------------------------------------------------------
HUB_DOMAIN = "hub"  # the trainer's JetStream domain (deploy/nats/single.conf)
BLOB_STREAM = f"OBJ_{BLOB_BUCKET}"
MIRRORED = (WEIGHTS, BLOB_STREAM)


@config_class
class MirrorConfig:
    """Retention of one region's mirrors. Set per region: deletes and purges on the hub are not
    mirrored, so without limits a mirror only grows."""

    hub_domain: Annotated[
        str, Field(min_length=1, description="the hub's JetStream domain (the mirrors' source)")
    ] = HUB_DOMAIN
    storage: Literal["file", "memory"] = "file"
    weights_keep: Annotated[
        int, Field(ge=1, description="last N messages per subject, like the hub's WEIGHTS")
    ] = 64
    blob_max_age_s: Annotated[
        float, Field(description="blob chunks and metas older than this are dropped")
    ] = 86400.0
    blob_max_bytes: Annotated[int, Field(description="-1: no byte cap")] = -1


def mirror_configs(m: MirrorConfig) -> list[api.StreamConfig]:
    storage = api.StorageType.FILE if m.storage == "file" else api.StorageType.MEMORY
    ext = api.ExternalStream(api=f"$JS.{m.hub_domain}.API")
    return [
        api.StreamConfig(
            name=WEIGHTS,
            mirror=api.StreamSource(name=WEIGHTS, external=ext),
            storage=storage,
            retention=api.RetentionPolicy.LIMITS,
            max_msgs_per_subject=m.weights_keep,
        ),
        # allow_direct: object metas are read with direct gets, as on the hub's bucket
        api.StreamConfig(
            name=BLOB_STREAM,
            mirror=api.StreamSource(name=BLOB_STREAM, external=ext),
            storage=storage,
            retention=api.RetentionPolicy.LIMITS,
            max_age=m.blob_max_age_s,
            max_bytes=m.blob_max_bytes,
            allow_direct=True,
        ),
    ]


_MIRROR_FIELDS = ("max_msgs_per_subject", "max_age", "max_bytes")


async def provision_mirrors(js, m: MirrorConfig | None = None, log=None) -> dict[str, str]:
    """On a region's server (`js` addresses the region's own domain): create the mirrors, or
    update their retention. A stream of that name that is not a mirror of the hub's is refused
    (a region must not hold its own WEIGHTS: two histories of one policy)."""
    m = m or MirrorConfig()
    done: dict[str, str] = {}
    for want in mirror_configs(m):
        try:
            have = (await js.stream_info(want.name)).config
        except NotFoundError:
            await _create(lambda w=want: js.add_stream(w))
            done[want.name] = "created"
            continue
        src = have.mirror
        if (
            src is None
            or src.name != want.mirror.name
            or (src.external is None or src.external.api != want.mirror.external.api)
        ):
            raise ValueError(
                f"stream {want.name} on this server is not a mirror of {want.mirror.name} in "
                f"domain {m.hub_domain!r} (mirror={src}); remove it by hand first"
            )
        changed = _differs(want, have, _MIRROR_FIELDS)
        if not changed:
            done[want.name] = "unchanged"
            continue
        await js.update_stream(dataclasses.replace(have, **{f: getattr(want, f) for f in changed}))
        done[want.name] = "updated"
        if log:
            log.info("mirror updated", stream=want.name, fields=changed)
    return done
