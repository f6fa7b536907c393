"""The run's own digest chain: which bf16 state each published version had, read back from WEIGHTS.

A keyframe event carries the digest of its state, a delta the digest of the state it produces
(`new_digest`); the broker holds them and only the leader may write there. A checkpoint is resumed
only if it agrees with that record:
    its version was published       its digest must be one the run published for that version
    its version is latest + 1       accepted (checkpoint first, then publish: a crash in between)
    further ahead than that         refused: the run never got there
    older than what WEIGHTS keeps   accepted (nothing left to compare with)
So a checkpoint planted in the checkpoint directory (or one from another run) is refused even when it
is a well-formed file; `checkpoint.load_latest(..., verify=chain.check)` then falls back to the newest
one that agrees. Manifests (versions published from shards) carry no state digest: they count as
published versions (so `latest` moves), with any digest accepted for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bus import topology as topo
from bus.events import DeltaEvent, EventError, KeyframeEvent, ManifestEvent, decode
from kernel import get_logger

from .checkpoint import CheckpointError, TrainerState

log = get_logger(__name__)

READ_BACK = 64  # WEIGHTS messages read back: far more than the checkpoints kept (keep_checkpoints)


@dataclass
class DigestChain:
    digests: dict[int, set[str]] = field(default_factory=dict)  # version -> state digests published
    latest: int = -1

    def add(self, version: int, digest: str) -> None:
        if digest:
            self.digests.setdefault(version, set()).add(digest)
        self.latest = max(self.latest, version)

    def check(self, st: TrainerState) -> None:
        """Raises CheckpointError unless `st` agrees with what the run published."""
        if self.latest < 0:
            return  # a fresh run (or a stream emptied by an operator)
        want = self.digests.get(st.version)
        if want is not None and st.digest not in want:
            raise CheckpointError(
                f"checkpoint v{st.version} (epoch {st.epoch}) has digest {st.digest!r}, "
                f"but the run published v{st.version} as {sorted(want)}: not this run's state"
            )
        if want is None and st.version > self.latest + 1:
            raise CheckpointError(
                f"checkpoint v{st.version} (epoch {st.epoch}) is ahead of every version the"
                f" run published (latest v{self.latest}): not this run's state"
            )


async def read_chain(bus, read_back: int = READ_BACK) -> DigestChain:
    """The digests of the last `read_back` WEIGHTS messages (none: an empty chain, checks nothing)."""
    chain = DigestChain()
    try:
        info = await bus.js.stream_info(topo.WEIGHTS)
    except Exception as e:  # no stream yet: a fresh run
        log.info("no WEIGHTS stream to check checkpoints against", error=str(e))
        return chain
    first, last = info.state.first_seq, info.state.last_seq
    for seq in range(last, max(first, last - read_back + 1) - 1, -1):
        if seq <= 0:
            break
        try:
            msg = await bus.js.get_msg(topo.WEIGHTS, seq=seq)
            ev = decode(msg.data)
        except EventError:
            continue
        except Exception as e:  # deleted or unreadable message: the rest still count
            log.debug("weights message not read", seq=seq, error=str(e))
            continue
        if isinstance(ev, KeyframeEvent):
            chain.add(ev.version, ev.digest)
        elif isinstance(ev, DeltaEvent):
            chain.add(ev.to_version, ev.new_digest)
        elif isinstance(ev, ManifestEvent):  # published from shards: the version, no digest
            chain.add(ev.to_version, "")
    return chain
