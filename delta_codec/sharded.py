"""Sharded publication: a version as N delta parts (one per trainer rank) plus one signed manifest.

Each rank encodes only the rows it owns of every parameter (FSDP2 shards dim 0), so encoding
scales with ranks instead of gathering the model on rank 0. A part is an ordinary Delta whose
tensor names carry the row range, `name@row0:row1`; the manifest lists every part's sha256 and
size and is signed once. A worker verifies the manifest, each part against it, and that the row
ranges of all parts tile every tensor of its state exactly, before it writes anything; parts then
apply in any order, and a failure in any part rolls back the parts already applied: a version is
taken whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

import torch

from . import signing
from .apply import apply_delta
from .bits import state_digest
from .delta import Delta
from .encode import encode_delta
from .errors import DeltaError

MAGIC = b"ASRLMAN1"
SCHEMA = 1
PART_NAME = re.compile(r"^(.*)@(\d+):(\d+)$")


def shard_rows(n_rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [r0, r1) of dim 0 that `rank` owns under FSDP2's even chunking (torch.chunk)."""
    c = -(-n_rows // world) if n_rows else 0
    return min(rank * c, n_rows), min((rank + 1) * c, n_rows)


def part_name(name: str, r0: int, r1: int) -> str:
    return f"{name}@{r0}:{r1}"


def encode_part(
    base: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    rows: dict[str, tuple[int, int]],
    *,
    from_version: int,
    to_version: int,
    **kw,
) -> Delta:
    """base/new: name -> this rank's rows (a tensor of rows r0..r1 of the full tensor); rows:
    name -> (r0, r1). Empty row ranges are left out (a small tensor may have no rows here)."""
    keep = [n for n in new if rows[n][1] > rows[n][0]]
    return encode_delta(
        {part_name(n, *rows[n]): base[n] for n in keep},
        {part_name(n, *rows[n]): new[n] for n in keep},
        from_version=from_version,
        to_version=to_version,
        **kw,
    )


@dataclass
class Manifest:
    from_version: int
    to_version: int
    parts: list[dict]  # [{"index", "sha256", "nbytes"}], index = rank
    extra: dict = field(default_factory=dict)
    signature: bytes = b""

    def _body(self) -> bytes:
        return json.dumps(
            {
                "schema": SCHEMA,
                "from_version": self.from_version,
                "to_version": self.to_version,
                "parts": self.parts,
                "extra": self.extra,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    def to_bytes(self, signing_key=None) -> bytes:
        body = self._body()
        sig = signing.sign(signing_key, body) if signing_key is not None else b""
        return MAGIC + len(body).to_bytes(4, "big") + body + sig

    @classmethod
    def from_bytes(cls, blob: bytes) -> Manifest:
        blob = bytes(blob)
        if blob[:8] != MAGIC or len(blob) < 12:
            raise DeltaError("not a sharded-version manifest (bad magic)")
        n = int.from_bytes(blob[8:12], "big")
        body, sig = blob[12 : 12 + n], blob[12 + n :]
        if len(body) != n or len(sig) not in (0, signing.SIGNATURE_BYTES):
            raise DeltaError("manifest truncated")
        try:
            d = json.loads(body)
            if d["schema"] != SCHEMA:
                raise DeltaError(f"manifest schema {d['schema']} is not {SCHEMA}")
            m = cls(int(d["from_version"]), int(d["to_version"]), list(d["parts"]), dict(d["extra"]), sig)
        except (KeyError, TypeError, ValueError) as e:
            raise DeltaError(f"manifest body is malformed: {e}") from None
        if m._body() != body:  # canonical form only: what was signed is what we read
            raise DeltaError("manifest body is not in canonical form")
        return m

    def verify_signature(self, public_key) -> None:
        if not self.signature:
            raise DeltaError("manifest is unsigned")
        signing.verify(public_key, self._body(), self.signature)


def make_manifest(
    blobs: list[bytes],
    *,
    from_version: int,
    to_version: int,
    extra: dict | None = None,
    names: list[str] | None = None,
) -> Manifest:
    """The manifest of parts blobs[i] (part i = rank i); `names`: where each part is stored (an
    object-store name), signed with the rest."""
    parts = [
        {"index": i, "sha256": hashlib.sha256(b).hexdigest(), "nbytes": len(b)} for i, b in enumerate(blobs)
    ]
    for p, n in zip(parts, names or []):
        p["blob"] = n
    return Manifest(from_version, to_version, parts, dict(extra or {}))


def check_part(manifest: Manifest, index: int, blob: bytes) -> Delta:
    """Part `index` against its manifest entry: size, sha256, and the versions inside it."""
    want = next((p for p in manifest.parts if p.get("index") == index), None)
    if want is None:
        raise DeltaError(f"version {manifest.to_version}: part {index} is not in the manifest")
    if len(blob) != want["nbytes"] or hashlib.sha256(bytes(blob)).hexdigest() != want["sha256"]:
        raise DeltaError(f"version {manifest.to_version}: part {index} does not match the manifest digest")
    d = Delta.from_bytes(blob)
    if (d.from_version, d.to_version) != (manifest.from_version, manifest.to_version):
        raise DeltaError(
            f"part {index} goes {d.from_version}->{d.to_version}, the manifest "
            f"{manifest.from_version}->{manifest.to_version}"
        )
    return d


def sharded_digest(state: dict[str, torch.Tensor], world: int) -> str:
    """The digest of a whole bf16 state as `world` ranks publish it: one state digest per rank's
    rows (= that part's Delta.new_digest), combined. Rank 0 records it from the parts alone, and a
    process holding the full state (a resume, any world size) recomputes it."""
    per_rank = []
    for r in range(world):
        rows = {n: (t, shard_rows(t.shape[0] if t.dim() else 1, r, world)) for n, t in state.items()}
        per_rank.append(
            state_digest(
                {
                    part_name(n, r0, r1): (t[r0:r1] if t.dim() else t)
                    for n, (t, (r0, r1)) in rows.items()
                    if r1 > r0
                }
            )
        )
    return parts_digest(per_rank)


def parts_digest(new_digests: list[str]) -> str:
    """`shards<N>:<sha256>` over the parts' new digests in rank order."""
    return f"shards{len(new_digests)}:" + hashlib.sha256("|".join(new_digests).encode()).hexdigest()


def digest_matches(state: dict[str, torch.Tensor], digest: str) -> bool:
    """`state` has `digest`, a whole-state digest or a sharded one (parts_digest)."""
    m = re.match(r"^shards(\d+):", digest)
    return (sharded_digest(state, int(m[1])) if m else state_digest(state)) == digest


def check_parts(state: dict[str, torch.Tensor], manifest: Manifest, blobs: dict[int, bytes]) -> list[Delta]:
    """Every listed part present and matching its digest, versions agreeing, row ranges tiling
    every tensor of `state` exactly once. -> the parsed parts."""
    want = {p["index"]: p for p in manifest.parts}
    if set(blobs) != set(want):
        raise DeltaError(
            f"version {manifest.to_version}: parts {sorted(set(want) - set(blobs))} missing, "
            f"{sorted(set(blobs) - set(want))} not in the manifest"
        )
    parts = [check_part(manifest, i, blobs[i]) for i in sorted(want)]
    cover: dict[str, list[tuple[int, int]]] = {}
    for d in parts:
        for r in d.records:
            m = PART_NAME.match(r.name)
            if not m or m[1] not in state:
                raise DeltaError(f"part record {r.name!r} names no tensor of the state")
            cover.setdefault(m[1], []).append((int(m[2]), int(m[3])))
    for name, t in state.items():
        spans, at = sorted(cover.get(name, [])), 0
        for r0, r1 in spans:
            if r0 != at or r1 <= r0:
                break
            at = r1
        if at != (t.shape[0] if t.dim() else 1) or not spans:
            raise DeltaError(
                f"tensor {name!r}: the parts' rows {spans} do not cover its {t.shape[0]} rows once"
            )
    return parts


def apply_parts(
    state: dict[str, torch.Tensor],
    manifest: Manifest | bytes,
    blobs: dict[int, bytes],
    *,
    public_key=None,
    expect_from: int | None = None,
    order: list[int] | None = None,
    finite: bool = False,
) -> None:
    """Apply a sharded version in place, all-or-nothing. `order`: the order parts are applied in
    (any order gives the same result; default: as listed). `finite`: as apply_delta's."""
    if not isinstance(manifest, Manifest):
        manifest = Manifest.from_bytes(manifest)
    if public_key is not None:
        manifest.verify_signature(public_key)
    if expect_from is not None and manifest.from_version != expect_from:
        raise DeltaError(
            f"version goes {manifest.from_version}->{manifest.to_version}, "
            f"but the state is version {expect_from}"
        )
    parts = dict(zip(sorted(blobs), check_parts(state, manifest, blobs)))
    applied: list[tuple[torch.Tensor, torch.Tensor]] = []  # undo copies of the rows written so far
    try:
        for i in order if order is not None else sorted(parts):
            views = {}
            for r in parts[i].records:
                m = PART_NAME.match(r.name)
                t = state[m[1]]
                views[r.name] = t[int(m[2]) : int(m[3])] if t.dim() else t
            saved = [(k, v.clone()) for k, v in views.items()]
            apply_delta(views, parts[i], finite=finite)  # itself all-or-nothing for this part
            applied += [(views[k], old) for k, old in saved]
    except Exception:
        for view, old in applied:
            view.copy_(old)
        raise
