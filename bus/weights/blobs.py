"""Blob transfer through the JetStream object store `rl-blobs` (payloads over the message size).

put: chunked by the object store, which records the SHA-256 of the whole object.
get: our own flow-controlled push consumer collects the chunks, hashing them as they arrive,
and joins them once (ObjectStore.get concatenates bytes, quadratic, or hops to a thread per
chunk: slow); a digest mismatch raises BlobError.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import time

import nats.js.errors as jse
from nats.js import api

from bus import topology as topo
from bus.errors import BlobError

CHUNK = 512 * 1024  # under the server's default 1 MiB max_payload, big enough to amortise acks


async def put_blob(bus, name: str, data) -> str:
    obs = await bus.blob_store()
    meta = api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=CHUNK))
    # the store hashes the chunks as it sends them (SHA-256): one pass, no second hash here
    info = await obs.put(name, io.BytesIO(data) if not isinstance(data, io.IOBase) else data, meta=meta)
    return _sha_of(info).hex()


def _sha_of(info) -> bytes:
    """The object's recorded SHA-256 ("SHA-256=<base64url>")."""
    return base64.urlsafe_b64decode(info.digest.split("=", 1)[1] + "==")


async def _info_when_there(obs, name: str, wait_s: float):
    """The object's meta. On a region's mirror it can arrive after the WEIGHTS event that names
    it (two mirrors, replicated independently): wait up to `wait_s` for it. The meta is put after
    the chunks, so once it is in the mirror, so are they."""
    deadline, delay = time.monotonic() + wait_s, 0.005
    while True:
        try:
            return await obs.get_info(name)
        except jse.NotFoundError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BlobError(
                    f"blob {name!r} not found in {topo.BLOB_BUCKET}"
                    + (f" (waited {wait_s}s)" if wait_s else "")
                ) from None
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 0.5)


async def get_blob(bus, name: str, timeout_s: float = 120.0, wait_s: float = 0.0) -> bytes:
    """Stream the chunks through a flow-controlled push consumer straight into one buffer.
    The consumer is bound by stream name (`topo.BLOB_STREAM`), never looked up by subject, so this
    also reads a mirror of the bucket's stream (which has no subjects of its own)."""
    obs = await bus.blob_store()
    info = await _info_when_there(obs, name, wait_s)
    if info.size == 0:
        return b""
    chunks: list[bytes] = []
    sha = hashlib.sha256()  # hashed as chunks arrive: overlaps with the server sending
    state = {"pos": 0, "chunks": 0, "error": None}
    done = asyncio.Event()

    async def on_msg(msg):
        if msg.headers and msg.headers.get(api.Header.STATUS):  # flow control / heartbeat
            reply = msg.reply or msg.headers.get(api.Header.CONSUMER_STALLED)
            if reply:
                await bus.nc.publish(reply, b"")
            return
        n, pos = len(msg.data), state["pos"]
        if pos + n > info.size:
            state["error"] = f"more bytes than the recorded size {info.size}"
            done.set()
            return
        chunks.append(msg.data)
        sha.update(msg.data)
        state["pos"], state["chunks"] = pos + n, state["chunks"] + 1
        if state["chunks"] == info.chunks:
            done.set()

    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox, cb=on_msg, pending_bytes_limit=256 * 1024 * 1024)
    cfg = api.ConsumerConfig(
        deliver_subject=inbox,
        filter_subject=f"$O.{topo.BLOB_BUCKET}.C.{info.nuid}",
        ack_policy=api.AckPolicy.NONE,
        deliver_policy=api.DeliverPolicy.ALL,
        flow_control=True,
        idle_heartbeat=5.0,
        mem_storage=True,
        inactive_threshold=30.0,
        num_replicas=1,
    )
    consumer = None
    try:
        consumer = (await bus.js.add_consumer(topo.BLOB_STREAM, cfg)).name
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except TimeoutError:
            raise BlobError(
                f"blob {name!r}: got {state['chunks']}/{info.chunks} chunks in {timeout_s}s"
            ) from None
    finally:
        await sub.unsubscribe()
        if consumer:
            try:
                await bus.js.delete_consumer(topo.BLOB_STREAM, consumer)
            except Exception:
                pass  # inactive_threshold removes it anyway
    if state["error"] or state["pos"] != info.size:
        raise BlobError(
            f"blob {name!r}: {state['error'] or 'short read'} ({state['pos']} of {info.size} bytes)"
        )
    got, want = sha.digest(), _sha_of(info)
    if got != want:
        raise BlobError(f"blob {name!r}: sha256 {got.hex()} != recorded {want.hex()} (corrupt)")
    return b"".join(chunks)  # the one copy into the result
