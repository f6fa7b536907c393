"""Prometheus metrics of every process: one registry per process, served on `/metrics`.

    serve_metrics(cfg.run)     # its [run] metrics_port (+ instance) on metrics_host; 0 = off
    start_metrics_server(port, addr)           # the port actually bound is returned (0: not served)

/metrics has no authentication: it listens on loopback unless a process's `metrics_host` says
otherwise (a container's private network: deploy/docker-compose.yml sets 0.0.0.0).

The metric objects below are module globals (prometheus_client's default registry) so that
library code (bus.weights, bus.client, rollout_worker.engine) records at its existing log points
with one call, and each process exports only what it actually touched. Names follow the
Prometheus conventions: counters end in `_total`, durations are `_seconds`, sizes `_bytes`.
`EXPORTED` lists every family; deploy/grafana's dashboard is checked against it (a panel naming
a metric nobody exports is a test failure, not an empty graph).
"""

from __future__ import annotations

import time

from kernel.log import get_logger

try:
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
except ImportError:  # a declared dependency; without it recording is a no-op and serving refuses
    REGISTRY = start_http_server = None

    class _Off:
        def __init__(self, *a, **k):
            pass

        def labels(self, *a, **k):
            return self

        def inc(self, *a, **k):
            pass

        def set(self, *a, **k):
            pass

        def observe(self, *a, **k):
            pass

    Counter = Gauge = Histogram = _Off

log = get_logger(__name__)

# update stalls are ~1 ms to ~1 s; publish→patched spans loopback (ms) to a WAN region (s)
_STALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# -- weights (trainer publishes, workers apply) -------------------------------------------------
VERSIONS_PUBLISHED = Counter(
    "asyncrl_versions_published_total", "Policy versions published, by kind", ["kind"]
)  # delta | keyframe
WEIGHT_BYTES_PUBLISHED = Counter("asyncrl_weight_published_bytes_total", "Payload bytes published", ["kind"])
VERSIONS_APPLIED = Counter("asyncrl_versions_applied_total", "Weight updates applied, by kind", ["kind"])
DELTAS_REFUSED = Counter("asyncrl_deltas_refused_total", "Weight updates refused, by reason", ["reason"])
PUBLISH_TO_PATCHED = Histogram(
    "asyncrl_publish_to_patched_seconds",
    "Stream time of a delta to the moment it is live in this process",
    buckets=_LATENCY_BUCKETS,
)
UPDATE_STALL = Histogram(
    "asyncrl_update_stall_seconds", "Decode stall caused by one weight update", buckets=_STALL_BUCKETS
)
POLICY_VERSION = Gauge(
    "asyncrl_policy_version", "Policy version this process holds (trainer: last published)"
)
WEIGHTS_UNSIGNED = Gauge(
    "asyncrl_weights_unsigned",
    "1: this process follows weights without checking their signature (no public key)",
)

# -- generation / scoring --------------------------------------------------------------------------
TOKENS_GENERATED = Counter("asyncrl_tokens_generated_total", "Completion tokens generated")
ROLLOUTS_PUBLISHED = Counter("asyncrl_rollouts_published_total", "Rollouts published by workers")
ROLLOUTS_SCORED = Counter(
    "asyncrl_rollouts_scored_total", "Rollouts scored, by env and verdict", ["env", "verdict"]
)  # verdict: success | failure
SLOT_OCCUPANCY = Gauge("asyncrl_slot_occupancy_ratio", "Mean KV slot occupancy over the engine's window")
WORKER_LAG = Gauge("asyncrl_worker_lag_versions", "Latest published version minus this worker's version")
SANDBOX_LAYER = Gauge(
    "asyncrl_sandbox_layer",
    "1: this isolation layer of the code sandbox is in place (start-up check, envs/isolation.py), 0: missing",
    ["layer"],
)

# -- bus -------------------------------------------------------------------------------------------
DLQ_PARKED = Counter(
    "asyncrl_dlq_parked_total", "Messages parked in the dead-letter queue, by stream", ["stream"]
)
CONSUMER_PENDING = Gauge(
    "asyncrl_consumer_pending_messages",
    "Messages not yet delivered to a durable consumer (from the last fetch)",
    ["stream", "consumer"],
)

# -- trainer ---------------------------------------------------------------------------------------
TRAINER_STEP = Histogram(
    "asyncrl_trainer_step_seconds", "Wall time of one optimizer step + publication", buckets=_STEP_BUCKETS
)
TRAINER_REWARD = Gauge("asyncrl_trainer_reward_mean", "Mean reward of the last batch")
TRAINER_SUCCESS = Gauge("asyncrl_trainer_success_ratio", "Mean success of the last batch")
TRAINER_STALENESS = Gauge("asyncrl_trainer_staleness_versions", "Mean sample lag of the last batch")
TRAINER_SAMPLES = Counter(
    "asyncrl_trainer_samples_total", "Samples trained on, by fate", ["fate"]
)  # live | stale
STEPS_SKIPPED = Counter(
    "asyncrl_steps_skipped_total", "Trainer steps skipped (weights untouched), by reason", ["reason"]
)  # nonfinite_loss | nonfinite_grad
DELTA_BYTES = Histogram(
    "asyncrl_delta_bytes", "Encoded delta size", buckets=tuple(2**k for k in range(10, 31, 2))
)

EXPORTED = frozenset(
    {
        "asyncrl_versions_published_total",
        "asyncrl_weight_published_bytes_total",
        "asyncrl_versions_applied_total",
        "asyncrl_deltas_refused_total",
        "asyncrl_publish_to_patched_seconds",
        "asyncrl_update_stall_seconds",
        "asyncrl_policy_version",
        "asyncrl_tokens_generated_total",
        "asyncrl_rollouts_published_total",
        "asyncrl_rollouts_scored_total",
        "asyncrl_slot_occupancy_ratio",
        "asyncrl_worker_lag_versions",
        "asyncrl_dlq_parked_total",
        "asyncrl_consumer_pending_messages",
        "asyncrl_trainer_step_seconds",
        "asyncrl_trainer_reward_mean",
        "asyncrl_trainer_success_ratio",
        "asyncrl_trainer_staleness_versions",
        "asyncrl_trainer_samples_total",
        "asyncrl_delta_bytes",
        "asyncrl_weights_unsigned",
        "asyncrl_steps_skipped_total",
        "asyncrl_sandbox_layer",
    }
)


def series(family: str) -> set[str]:
    """Sample names a family exposes: a histogram's _bucket/_sum/_count, a counter's own name."""
    if family.endswith("_total"):
        return {family}
    hist = family in {
        "asyncrl_publish_to_patched_seconds",
        "asyncrl_update_stall_seconds",
        "asyncrl_trainer_step_seconds",
        "asyncrl_delta_bytes",
    }
    return {f"{family}_bucket", f"{family}_sum", f"{family}_count"} if hist else {family}


def serve_metrics(run) -> int:
    """A process's /metrics from its run section: port metrics_port + instance (several
    instances on one host: systemd's %i), address metrics_host (loopback by default)."""
    port = int(run.metrics_port or 0)
    if not port:
        return 0
    return start_metrics_server(port + int(getattr(run, "instance", 0) or 0), run.metrics_host)


def start_metrics_server(port: int, addr: str = "127.0.0.1") -> int:
    """Serve /metrics on `port` (0 = off, returns 0). A port already taken is logged, not fatal:
    metrics must never keep a trainer or worker from running."""
    if not port:
        return 0
    if start_http_server is None:
        raise RuntimeError(
            "metrics_port is set but prometheus_client is not installed (pip install prometheus_client)"
        )
    try:
        server, _thread = start_http_server(int(port), addr=addr)
    except OSError as e:
        log.error("metrics server not started", port=port, error=str(e))
        return 0
    bound = server.server_address[1]
    log.info("metrics served", addr=addr, port=bound, path="/metrics")
    return bound


# -- one-line recorders for existing log points ----------------------------------------------------
def published(kind: str, nbytes: int, version: int) -> None:
    VERSIONS_PUBLISHED.labels(kind).inc()
    WEIGHT_BYTES_PUBLISHED.labels(kind).inc(nbytes)
    if kind in ("delta", "manifest"):  # a manifest is a version published from shards
        POLICY_VERSION.set(version)


def applied(kind: str, raw) -> None:
    VERSIONS_APPLIED.labels(kind).inc()
    if kind in ("delta", "manifest"):
        observe_patched(raw)


def observe_patched(raw) -> None:
    """A WEIGHTS message (RawStreamMsg) was applied: its stream time -> now."""
    t = getattr(raw, "time", None)
    if t is not None and hasattr(t, "timestamp"):
        PUBLISH_TO_PATCHED.observe(max(0.0, time.time() - t.timestamp()))


def observe_pending(msg, stream: str, consumer: str) -> None:
    """Consumer backlog as JetStream reports it with every delivered message."""
    try:
        CONSUMER_PENDING.labels(stream, consumer).set(msg.metadata.num_pending)
    except Exception:  # a message without JetStream metadata: nothing to say
        pass


def observe_trainer_step(values: dict) -> None:
    """The trainer's per-version metrics dict (trainer/leader.py `values`)."""
    if "total_s" in values:
        TRAINER_STEP.observe(float(values["total_s"]))
    if values.get("delta_bytes"):
        DELTA_BYTES.observe(float(values["delta_bytes"]))
    for key, gauge in (
        ("reward_mean", TRAINER_REWARD),
        ("success_mean", TRAINER_SUCCESS),
        ("staleness_mean", TRAINER_STALENESS),
        ("version", POLICY_VERSION),
    ):
        if isinstance(values.get(key), (int, float)):
            gauge.set(float(values[key]))
    live, stale = int(values.get("live_samples", 0) or 0), int(values.get("dropped_stale", 0) or 0)
    TRAINER_SAMPLES.labels("live").inc(live)
    TRAINER_SAMPLES.labels("stale").inc(stale)


def observe_sandbox(layers: dict[str, bool]) -> None:
    """The sandbox's isolation layers (envs.isolation.check()) as 0/1 gauges."""
    for layer, ok in layers.items():
        SANDBOX_LAYER.labels(layer).set(1 if ok else 0)


def observe_worker(snapshot: dict) -> None:
    """A worker's heartbeat snapshot (rollout_worker.worker.Worker.snapshot)."""
    for key, gauge in (("version", POLICY_VERSION), ("lag", WORKER_LAG), ("slot_occupancy", SLOT_OCCUPANCY)):
        if isinstance(snapshot.get(key), (int, float)) and not isinstance(snapshot.get(key), bool):
            gauge.set(float(snapshot[key]))
