"""`asyncrl up` test helpers: the small run's config with fast supervision (restarts and backoff
in seconds, no evals), shared by the supervision, signal and resume tests."""

from __future__ import annotations

from bench.up_driver import SMALL_RUN

SUPERVISE = SMALL_RUN.replace(
    "[up]\n", "[up]\ngrace_s = 3.0\nmax_restarts = 3\nrestart_backoff_s = 0.5\n"
).replace("eval_every = 3", "eval_every = 0")
