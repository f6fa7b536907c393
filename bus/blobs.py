"""Blob transfer through the JetStream object store `rl-blobs` (payloads over the message size).

put: chunked by the object store; we record our own sha256 in the object's headers.
get: our own flow-controlled push consumer writes the chunks into one preallocated buffer
(ObjectStore.get concatenates bytes, quadratic, or hops to a thread per chunk: slow), then the
sha256 is checked against the store's digest and the one we recorded.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import io

import nats.js.errors as jse
from nats.js import api

CHUNK = 512 * 1024        # under the server's default 1 MiB max_payload, big enough to amortise acks
SHA_HEADER = "Rl-Sha256"


async def put_blob(bus, name: str, data) -> str:
    obs = await bus._blobs()
    digest = hashlib.sha256(data).hexdigest()
    meta = api.ObjectMeta(name=name, headers={SHA_HEADER: digest},
                          options=api.ObjectMetaOptions(max_chunk_size=CHUNK))
    await obs.put(name, io.BytesIO(data) if not isinstance(data, io.IOBase) else data, meta=meta)
    return digest


async def get_blob(bus, name: str, timeout_s: float = 120.0) -> bytes:
    """Stream the chunks through a flow-controlled push consumer straight into one buffer."""
    from bus.client import BlobError
    obs = await bus._blobs()
    try:
        info = await obs.get_info(name)
    except jse.NotFoundError:
        raise BlobError(f"blob {name!r} not found in {obs._name}") from None
    if info.size == 0:
        return b""
    buf = bytearray(info.size)
    view = memoryview(buf)
    state = {"pos": 0, "chunks": 0, "error": None}
    done = asyncio.Event()

    async def on_msg(msg):
        if msg.headers and msg.headers.get(api.Header.STATUS):   # flow control / heartbeat
            reply = msg.reply or msg.headers.get(api.Header.CONSUMER_STALLED)
            if reply:
                await bus.nc.publish(reply, b"")
            return
        n, pos = len(msg.data), state["pos"]
        if pos + n > len(buf):
            state["error"] = f"more bytes than the recorded size {info.size}"
            done.set()
            return
        view[pos:pos + n] = msg.data
        state["pos"], state["chunks"] = pos + n, state["chunks"] + 1
        if state["chunks"] == info.chunks:
            done.set()

    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox, cb=on_msg, pending_bytes_limit=256 * 1024 * 1024)
    cfg = api.ConsumerConfig(deliver_subject=inbox, filter_subject=f"$O.{obs._name}.C.{info.nuid}",
                             ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL,
                             flow_control=True, idle_heartbeat=5.0, mem_storage=True,
                             inactive_threshold=30.0, num_replicas=1)
    consumer = None
    try:
        consumer = (await bus.js.add_consumer(obs._stream, cfg)).name
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise BlobError(f"blob {name!r}: got {state['chunks']}/{info.chunks} chunks in {timeout_s}s") from None
    finally:
        await sub.unsubscribe()
        if consumer:
            try:
                await bus.js.delete_consumer(obs._stream, consumer)
            except Exception:
                pass  # inactive_threshold removes it anyway
    if state["error"] or state["pos"] != info.size:
        raise BlobError(f"blob {name!r}: {state['error'] or 'short read'} ({state['pos']} of {info.size} bytes)")
    sha = await asyncio.to_thread(lambda: hashlib.sha256(view).digest())
    want = base64.urlsafe_b64decode(info.digest.split("=", 1)[1] + "==") if info.digest else None
    if want is not None and sha != want:
        raise BlobError(f"blob {name!r}: sha256 {sha.hex()} != recorded {want.hex()} (corrupt)")
    rl = (info.headers or {}).get(SHA_HEADER)
    if rl and rl != sha.hex():
        raise BlobError(f"blob {name!r}: sha256 {sha.hex()} != recorded {rl} (corrupt)")
    view.release()
    return bytes(buf)
