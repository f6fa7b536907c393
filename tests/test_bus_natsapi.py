"""What asyncrl assumes about nats-py and the server without touching their private attributes:
the JetStream API prefix per domain, and the object store's stream naming (OBJ_<bucket>)."""

import nats
import pytest

from bus import BusConfig, connect
from bus import topology as topo


@pytest.mark.parametrize("domain", [None, "hub", "eu-west"])
async def test_api_prefix_matches_the_clients_requests(nats_server, domain):
    """A request to `<prefix>.INFO` must be what the client itself sends for account info."""
    nc = await nats.connect(nats_server.url)
    try:
        seen = []
        real = nc.request

        async def spy(subject, *a, **kw):
            seen.append(subject)
            return await real(subject, *a, **kw)

        nc.request = spy
        js = nc.jetstream(domain=domain)
        try:
            await js.account_info()
        except Exception:
            pass  # an unknown domain has no responder: the subject is what counts
        assert seen and seen[0] == f"{topo.api_prefix(domain)}.INFO"
    finally:
        await nc.close()


async def test_blob_bucket_lives_in_the_stream_we_bind_to(nats_server):
    bus = await connect(BusConfig(servers=[nats_server.url], name="t"))
    try:
        await bus.provision()
        await bus.put_blob("x", b"abc")
        info = await bus.js.stream_info(topo.BLOB_STREAM)
        assert info.state.messages >= 1
        assert await bus.get_blob("x") == b"abc"
    finally:
        await bus.close()
