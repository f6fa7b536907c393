"""Sizes and timings of every chaos run: tiny and fast, so a 200-task run lasts minutes on 2 cores."""

from __future__ import annotations

# a 1-layer model and 48-token answers keep a 200-task run within minutes on 2 cores


MODEL = {
    "preset": "tiny",
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 1,
    "d_ff": 64,
    "max_seq_len": 96,
}


GROUP = 2  # completions per task


BATCH_GROUPS = 4  # tasks per trainer step


MAX_TOKENS = 48


RATE = 5.0  # tasks published per second: a 200-task run lasts ~40 s


ACK_WAIT_S = 6.0  # short, so a dead worker's tasks come back quickly; handlers heartbeat every 2 s


LEASE_TTL_S = 4.0
