"""zstd for every byte stream of the codec: one parameter set, and per-thread contexts (reused:
cheaper; never shared across threads). A corrupt or mis-sized stream is a DeltaError."""

from __future__ import annotations

import threading

import zstandard

from .errors import DeltaError

# zstd "fast" with long minimum matches and a tiny hash table: on these streams (value codes,
# gap bytes, byte planes of weights) matches are rare, so level 1's match search mostly costs
# time and its short matches cost bits (measured faster and smaller than level 1 on value and
# keyframe planes: docs/benchmarks.md).


ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST,
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
)


_tls = threading.local()  # zstd contexts are reused (cheaper) but not shared across threads


def zc(data) -> bytes:
    if not hasattr(_tls, "c"):
        _tls.c = zstandard.ZstdCompressor(compression_params=ZSTD_PARAMS)
    return _tls.c.compress(data)


def zc_blocks(parts) -> bytes:
    """One zstd frame holding the parts back to back, each non-empty part in its own block(s):
    each keeps its own literal (Huffman) table, or raw literals where coding would not pay,
    while the parts share one frame header (small streams cost a few bytes, not a frame)."""
    if not hasattr(_tls, "c"):
        _tls.c = zstandard.ZstdCompressor(compression_params=ZSTD_PARAMS)
    parts = [p for p in parts if len(p)]
    o = _tls.c.compressobj(size=sum(len(p) for p in parts))
    out = []
    for p in parts:
        out.append(o.compress(p))
        out.append(o.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(o.flush())
    return b"".join(out)


def zd(data, size: int, what: str, exact: bool = True) -> bytes:
    """zstd-decompressed data of `size` bytes (exact=False: at most size; the caller checks)."""
    if not hasattr(_tls, "d"):
        _tls.d = zstandard.ZstdDecompressor()
    try:
        out = _tls.d.decompress(data, max_output_size=size)
    except zstandard.ZstdError as e:
        raise DeltaError(f"{what}: zstd stream is corrupt ({e})") from None
    if exact and len(out) != size:
        raise DeltaError(f"{what}: decompressed {len(out)} bytes, expected {size}")
    return out
