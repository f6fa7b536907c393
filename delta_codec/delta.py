"""Delta: a lossless sparse change from one state version to the next, and its stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from .bits import combine_digest
from .container import KIND_DELTA, SignedBlob, blob_head, extra_fields, pack_blob, unpack_blob, with_extra
from .errors import DeltaError
from .record import TensorRecord, chunks_of

_STATE_DIGEST = 16  # bytes (bits.combine_digest: xxh3-128)


@dataclass
class DeltaStats:
    changed: int
    total: int
    encoded_bytes: int
    per_tensor: dict[str, dict] = field(default_factory=dict)

    @property
    def changed_frac(self) -> float:
        return self.changed / max(self.total, 1)

    @property
    def bits_per_changed(self) -> float:
        return 8 * self.encoded_bytes / max(self.changed, 1)

    def to_dict(self) -> dict:
        return {
            "changed": self.changed,
            "total": self.total,
            "encoded_bytes": self.encoded_bytes,
            "changed_frac": self.changed_frac,
            "bits_per_changed": self.bits_per_changed,
            "per_tensor": self.per_tensor,
        }


class Delta(SignedBlob):
    """Lossless sparse change from state `from_version` to `to_version`."""

    def __init__(
        self,
        from_version: int,
        to_version: int,
        records: list[TensorRecord],
        extra: dict | None = None,
        *,
        base_digest: str | None = None,
        new_digest: str | None = None,
    ):
        """base_digest / new_digest: the state digests (bits.state_digest of the base and of the
        result); by default combined from the records' tensor digests, which encode_delta's
        records have and a parsed delta's do not (its state digests travel in the header)."""
        self.from_version, self.to_version, self.records = int(from_version), int(to_version), records
        self.extra = extra_fields(
            extra
        )  # caller's header fields (e.g. epoch): checksummed and signed with the blob
        self._digests = {"base": base_digest, "new": new_digest}
        self._nbytes: int | None = None
        self._stats: DeltaStats | None = None

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.records]

    @property
    def base_digest(self) -> str:
        """bits.state_digest of the state this delta applies to."""
        return self._digest("base")

    @property
    def new_digest(self) -> str:
        """bits.state_digest of the state it produces."""
        return self._digest("new")

    def _digest(self, which: str) -> str:
        if self._digests[which] is None:
            digs = [r.digest_a if which == "base" else r.digest_b for r in self.records]
            if any(d is None for d in digs):
                raise DeltaError(f"delta records carry no tensor digests: give the {which} state digest")
            self._digests[which] = combine_digest(
                (r.name, r.dtype, r.shape, d) for r, d in zip(self.records, digs)
            )
        return self._digests[which]

    @property
    def stats(self) -> DeltaStats:
        if self._stats is None:
            self._stats = self._compute_stats()
        return self._stats

    def _compute_stats(self) -> DeltaStats:
        per = {}
        for r in self.records:
            if r.changed < 0:
                r.changed = sum(int(c[2]) for c in chunks_of(r))
            per[r.name] = {"changed": r.changed, "total": r.numel, "bytes": r.nbytes}
        return DeltaStats(
            sum(p["changed"] for p in per.values()), sum(p["total"] for p in per.values()), self.nbytes, per
        )

    @property
    def nbytes(self) -> int:
        """Size of to_bytes() without a signature."""
        if self._nbytes is None:  # (without building the blob)
            self._nbytes = len(blob_head(KIND_DELTA, self._meta(), self.records, False)) + sum(
                r.nbytes for r in self.records
            )
        return self._nbytes

    def _meta(self) -> dict:
        return with_extra(
            {
                "from_version": self.from_version,
                "to_version": self.to_version,
                "base": bytes.fromhex(self.base_digest),
                "new": bytes.fromhex(self.new_digest),
            },
            self.extra,
        )

    def to_bytes(self, signing_key=None) -> bytes:
        return pack_blob(KIND_DELTA, self._meta(), self.records, signing_key)

    @classmethod
    def from_bytes(cls, blob) -> Delta:
        meta, recs, region, sig = unpack_blob(blob, KIND_DELTA)
        try:
            digests = [meta[k] for k in ("base", "new")]
            if not all(isinstance(d, bytes) and len(d) == _STATE_DIGEST for d in digests):
                raise ValueError("state digests are not 16 bytes each")
            d = cls(
                meta["from_version"],
                meta["to_version"],
                recs,
                meta.get("extra"),
                base_digest=digests[0].hex(),
                new_digest=digests[1].hex(),
            )
        except (KeyError, TypeError, ValueError):
            raise DeltaError(
                "delta header lacks from_version/to_version or its base/new state digests"
            ) from None
        d.signature, d._signed_region = sig, region
        return d

    def __repr__(self) -> str:
        return f"Delta({self.from_version}->{self.to_version}, {len(self.records)} tensors)"
