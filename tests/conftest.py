"""Shared fixtures: a real nats-server (JetStream, file store) per session, or per test.

async def test_x(nats_server):          # session-wide server; use unique subjects/ids
    bus = await connect(BusConfig(servers=[nats_server.url], name="t"))
async def test_y(fresh_server):         # own server + store dir; `await fresh_server.restart()`
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest
import pytest_asyncio
import torch

from asyncrl.nats_server import EmbeddedServer

# 2-core CI box: torch's default intra-op threads thrash small matmuls (10x slower measured), so one
# thread unless OMP_NUM_THREADS says otherwise: `make test-numeric` runs the numeric tests under 1 and 2
# (another reduction order) so that a tolerance which holds on one order only fails in CI
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))

# skip reasons name the apt package that brings the tool: "... apt-get install [-y] <pkg>"
_APT = re.compile(r"apt-get install (?:-y )?([a-z0-9][a-z0-9.+-]*)")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Close every run with what it skipped, why, and the apt line that brings the missing tools,
    so a run that checks less than CI's says so."""
    reasons = Counter()
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    deselected = len(terminalreporter.stats.get("deselected", []))
    # under pytest-xdist (make test) the workers deselect: the controller only knows the expression
    markexpr = "" if deselected else (config.getoption("markexpr", "") or "")
    if not reasons and not deselected and not markexpr:
        return
    tr = terminalreporter
    tr.section("what this run did not check")
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"skipped {n}: {reason}")
    if deselected or markexpr:
        what = (
            f"not selected {deselected}: by -m/-k"
            if deselected
            else f"not selected: what -m '{markexpr}' leaves out"
        )
        tr.write_line(
            f"{what} (by default the chaos, vllm and bench tests: "
            "make test-chaos, make test-vllm, make test-bench)"
        )
    pkgs = sorted({m for r in reasons for m in _APT.findall(r)})
    if pkgs:
        tr.write_line(
            f"install: apt-get install -y {' '.join(pkgs)}   "
            "(make test does it itself when run as root on Debian; docs/testing.md)"
        )


# The shared test brokers keep nats-server's own flush interval: tests that read a consumer's ack
# count right after acking raced the fsync'd consumer state. The product's default
# (sync_interval always) is tested by tests/test_nats_durability.py and by every `asyncrl up` test.
TEST_SYNC = None


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    srv = EmbeddedServer(store_dir=tmp_path_factory.mktemp("nats-session"), sync=TEST_SYNC)
    srv.start_sync()
    yield srv
    srv.stop_sync()


@pytest.fixture
def fresh_server(tmp_path):
    srv = EmbeddedServer(store_dir=tmp_path / "nats", sync=TEST_SYNC)
    srv.start_sync()
    yield srv
    srv.stop_sync()


@pytest_asyncio.fixture
async def bus(fresh_server):
    """A connected, provisioned Bus on its own fresh server."""
    from bus import BusConfig, connect

    b = await connect(BusConfig(servers=[fresh_server.url], name="test"))
    await b.provision()
    yield b
    await b.close()
