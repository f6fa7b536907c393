"""A remote sandbox's test-suite time, modelled: a workspace backend wrapper that adds wall time to
every test-suite run (the agent's `run_tests` and the scoring run of the hidden tests).

Why: the generated tier-1 repositories' tests run in tenths of a second, while real SWE episodes
run test suites that take seconds to minutes, with a long tail; in production the sandbox runs on
other machines, so that time costs the inference machine wall time, not CPU. The extra time is
spent in `time.sleep` in the episode's pool thread (no local CPU, the GIL released) and counted in
the command's `wall_s` (so in the episode's `tool_wall_s`).

The time of a task's suite is a property of its repository: one deterministic draw per task id
(and `seed`) from a lognormal distribution with the given median and 99th percentile, capped at
`cap_s`; every suite run of that task (each `run_tests`, the scoring run) takes it. The commands
themselves still run here, so the observations are the real ones.

    backend = LatencyBackend(LocalBackend(), SandboxLatency(median_s=3.0, p99_s=60.0))
    Episode(task, limits, backend=backend)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import time
from statistics import NormalDist

from kernel.config import config_class

# a command that calls the test helper: `run_tests`, `run_tests -k x`, `cd pkg && run_tests | cat`
_RUNS_TESTS = re.compile(r"(?:^|[\s;&|(])run_tests(?=$|[\s;&|)])")
_Z99 = NormalDist().inv_cdf(0.99)


@config_class(frozen=True)
class SandboxLatency:
    median_s: float = 0.0  # median extra seconds of a test-suite run; 0: off
    p99_s: float = 0.0  # its 99th percentile (>= median_s); sets the lognormal's sigma
    cap_s: float = 300.0  # no suite takes longer than this
    seed: int = 0  # another draw of the per-task times

    def __post_init__(self):
        if self.median_s < 0 or (self.median_s > 0 and not (self.p99_s >= self.median_s and self.cap_s > 0)):
            raise ValueError(
                f"sandbox latency needs median_s >= 0 and, when on, p99_s >= median_s > 0 and "
                f"cap_s > 0: got median_s={self.median_s}, p99_s={self.p99_s}, cap_s={self.cap_s}"
            )

    @property
    def enabled(self) -> bool:
        return self.median_s > 0

    @property
    def sigma(self) -> float:
        return math.log(self.p99_s / self.median_s) / _Z99 if self.enabled else 0.0

    def seconds(self, task_id: str) -> float:
        """The test-suite time of `task_id` (0.0 when off): the same for every call."""
        if not self.enabled:
            return 0.0
        h = int.from_bytes(
            hashlib.blake2b(f"{self.seed}|{task_id}".encode(), digest_size=8).digest(), "little"
        )
        u = (h + 0.5) / 2**64  # uniform in (0, 1), never 0 or 1
        return min(self.median_s * math.exp(self.sigma * NormalDist().inv_cdf(u)), self.cap_s)


def runs_tests(command: str) -> bool:
    """Whether a command calls the test helper (anywhere a command word can stand)."""
    return _RUNS_TESTS.search(command) is not None


class LatencyBackend:
    """Wraps a workspace backend: its workspaces' test-suite runs take `latency`'s time of the task
    on top (picklable when the inner backend is)."""

    def __init__(self, inner, latency: SandboxLatency):
        self.inner, self.latency = inner, latency

    def create(self, task, limits) -> LatencyWorkspace:
        return LatencyWorkspace(self.inner.create(task, limits), self.latency.seconds(task.task_id))


class LatencyWorkspace:
    def __init__(self, inner, suite_s: float):
        self.inner, self.suite_s = inner, suite_s
        self.waited_s = 0.0  # seconds of modelled remote time so far
        self.suite_runs = 0  # test-suite runs (agent's and scoring) so far

    @property
    def error(self) -> str:
        return self.inner.error

    @property
    def score_info(self):
        return getattr(self.inner, "score_info", None)

    def _wait(self) -> float:
        time.sleep(self.suite_s)  # a remote machine's time: no local CPU
        self.suite_runs += 1
        self.waited_s += self.suite_s
        return self.suite_s

    def run(self, command, limits):
        res = self.inner.run(command, limits)
        if runs_tests(command) and self.suite_s > 0:
            res = dataclasses.replace(res, wall_s=res.wall_s + self._wait())
        return res

    def over_limit(self, max_mb: int, max_files: int) -> str:
        return self.inner.over_limit(max_mb, max_files)

    def run_hidden_tests(self, task, limits):
        out = self.inner.run_hidden_tests(task, limits)
        if self.suite_s > 0:
            self._wait()
        return out

    def close(self) -> None:
        self.inner.close()
