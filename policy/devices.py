"""The devices this process was given, as its environment says, for its start-up log line.

`asyncrl up` with a [layout] starts each process with CUDA_VISIBLE_DEVICES (its GPUs; "" on a
CPU layout) and ASYNCRL_DEVICES (its share of the plan, "cuda:4,cuda:5" or "cpu:0"); torchrun adds
RANK, LOCAL_RANK and WORLD_SIZE to each rank of the trainer group. Every trainer rank and rollout
worker logs these once at start ("devices"), so each process shows where it runs (docs/gpu.md).
"""

from __future__ import annotations

import os

# variable -> log field; absent variables are logged as None (not set: no [layout], no torchrun)
FIELDS = {
    "ASYNCRL_DEVICES": "plan",
    "CUDA_VISIBLE_DEVICES": "cuda_visible_devices",
    "RANK": "rank",
    "LOCAL_RANK": "local_rank",
    "WORLD_SIZE": "world_size",
}


def device_env(environ=None) -> dict:
    """{log field: value} of the device variables of this process's environment."""
    env = os.environ if environ is None else environ
    return {field: env.get(var) for var, field in FIELDS.items()}
