"""Shared fixtures: a real nats-server (JetStream, file store) per session, or per test.

    async def test_x(nats_server):          # session-wide server; use unique subjects/ids
        bus = await connect(BusConfig(servers=[nats_server.url], name="t"))
    async def test_y(fresh_server):         # own server + store dir; `await fresh_server.restart()`
"""
from __future__ import annotations

import pytest
import pytest_asyncio
import torch

from bus.server import EmbeddedServer

# 2-core CI box: torch's default intra-op threads thrash small matmuls (10x slower measured)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    srv = EmbeddedServer(store_dir=tmp_path_factory.mktemp("nats-session"))
    srv.start_sync()
    yield srv
    srv.stop_sync()


@pytest.fixture
def fresh_server(tmp_path):
    srv = EmbeddedServer(store_dir=tmp_path / "nats")
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
