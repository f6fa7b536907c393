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
TELEMETRY = "TELEMETRY"        # heartbeats + metrics (limits retention), for `asyncrl inspect` and `up`

# subjects
def task_subject(env: str) -> str: return f"rl.tasks.{env}"
def rollout_subject(env: str) -> str: return f"rl.rollouts.{env}"
def scored_subject(env: str) -> str: return f"rl.scored.{env}"
def dlq_subject(stream: str) -> str: return f"rl.dlq.{stream}"
def heartbeat_subject(component: str, cid: str) -> str: return f"rl.heartbeat.{component}.{cid}"
def metrics_subject(component: str, cid: str) -> str: return f"rl.metrics.{component}.{cid}"
DELTA_SUBJECT = "rl.weights.delta"
KEYFRAME_SUBJECT = "rl.weights.keyframe"

# durable consumers
ROLLOUT_CONSUMER = "rollout"    # on TASKS, shared by all workers
SCORER_CONSUMER = "scorer"      # on ROLLOUTS, shared by all scorers
TRAINER_CONSUMER = "trainer"    # on SCORED, leader fetches

# KV bucket and keys; object store
CONTROL_BUCKET = "rl-control"
KEY_VERSION = "version"
KEY_LEADER = "leader"
KEY_LAMBDA = "lambda"
KEY_CONFIG = "config"
BLOB_BUCKET = "rl-blobs"
