"""Blob transfer through the object store: 200 MB bit-exact, corruption detected, bad names refused."""

from __future__ import annotations

import numpy as np
import pytest

from bus import BlobError
from bus import topology as topo


async def test_blob_200mb_round_trip_bit_exact(bus):
    data = np.random.default_rng(0).integers(0, 256, size=200 * 1024 * 1024, dtype=np.uint8).tobytes()
    digest = await bus.put_blob("big", data)
    got = await bus.get_blob("big")
    assert len(got) == len(data) and got == data
    import hashlib

    assert digest == hashlib.sha256(data).hexdigest()
    await bus.delete_blob("big")


async def test_blob_small_empty_overwrite_and_missing(bus):
    assert await bus.put_blob("e", b"") and await bus.get_blob("e") == b""
    await bus.put_blob("s", b"v1" * 1000)
    await bus.put_blob("s", b"v2" * 3)  # overwrite by name
    assert await bus.get_blob("s") == b"v2" * 3
    with pytest.raises(BlobError, match="not found"):
        await bus.get_blob("nope")


async def test_blob_corruption_is_detected(bus):
    await bus.put_blob("c", b"x" * 5000)
    obs = await bus.js.object_store(topo.BLOB_BUCKET)
    info = await obs.get_info("c")
    # overwrite one chunk in place: publish a different payload for the same chunk subject after
    # purging the original (what a truncated/garbled store would look like)
    subj = f"$O.{topo.BLOB_BUCKET}.C.{info.nuid}"
    await bus.js.purge_stream(f"OBJ_{topo.BLOB_BUCKET}", subject=subj)
    await bus.js.publish(subj, b"y" * 5000)
    with pytest.raises(BlobError, match="sha256"):
        await bus.get_blob("c")
