"""How the leader turns the learner's new weights into the version it publishes: one encoder, chosen
once at startup by `[trainer.publish] layout` (`make_encoder`), behind one interface.

    gathered  the whole bf16 state on rank 0, diffed against the last published one
              (delta_codec.encode_delta) -> GatheredVersion (bus/weights/publisher.py)
    sharded   every rank encodes the delta of its own rows (Learner.publish_parts, a collective);
              rank 0 gets the parts -> ShardedVersion (bus/weights/manifest.py). The whole state is
              still gathered for a keyframe or an evaluation (`ShardedEncoder.needs_full_state`).

In two phases, as the leader's step and publication run (trainer/leader.py):
    take     in the step's critical path, before the next step may change the weights: what the
             learner must hand over now (the gathered state, or the parts: a collective), -> `Taken`
    encode   in the publication, which overlaps the next step: `Taken.encode` -> the EncodedVersion
             to publish (None when the batch trained nothing); the gathered delta is coded here.
Either version carries the full state as its keyframe every `keyframe_interval` versions; the
leader publishes it with `WeightPublisher.publish` and reads the same fields of both.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import delta_codec
from bus.weights.manifest import ShardedVersion, publish_sharded
from bus.weights.publisher import EncodedVersion, GatheredVersion, WeightPublisher

from .config import TrainerConfig


class Taken(ABC):
    """Version v as the step left it: `state`, the full bf16 state of v when it was gathered (the
    finite check, keyframes, evaluations, the next gathered base), else None; `encode` makes the
    version to publish."""

    state: dict | None

    @abstractmethod
    async def encode(self, stats: dict) -> EncodedVersion | None:
        """The version to publish, None when nothing was trained; sets `stats["encode_s"]` when
        the coding happens here."""


@dataclass
class TakenState(Taken):
    """Gathered: the published state of v-1 and the state of v, coded into a delta in `encode`."""

    base: dict
    state: dict
    from_version: int
    to_version: int
    live: bool
    keyframe: bool  # v also goes out as a keyframe
    context: bool = False  # delta_codec's context coding of positions

    async def encode(self, stats: dict) -> EncodedVersion | None:
        if not self.live:
            return None
        te = time.perf_counter()
        delta = await asyncio.to_thread(
            delta_codec.encode_delta,
            self.base,
            self.state,
            from_version=self.from_version,
            to_version=self.to_version,
            context=self.context,
        )
        stats["encode_s"] = time.perf_counter() - te
        return GatheredVersion(delta, keyframe=self.state if self.keyframe else None)


@dataclass
class TakenParts(Taken):
    """Sharded: the version, already encoded by the ranks in `take` (None: nothing trained)."""

    version: ShardedVersion | None
    state: dict | None

    async def encode(self, stats: dict) -> EncodedVersion | None:
        return self.version


class VersionEncoder(ABC):
    """Encodes each version the leader publishes (see the module docstring)."""

    def __init__(self, cfg: TrainerConfig, learner):
        self.cfg, self.learner = cfg, learner

    def keyframe_due(self, version: int) -> bool:
        return version % self.cfg.publish.keyframe_interval == 0

    @abstractmethod
    def start(self) -> None:
        """Newly leading, the state just published (the keyframe) is the base of the next version."""

    @abstractmethod
    async def take(self, published: dict, live: bool, version: int, stats: dict) -> Taken:
        """Version `version` (`live`: the batch trained it, else nothing changed) right after its step;
        `published`: the state of the last version the leader holds (the gathered base). Sets
        `stats["encode_s"]` when the coding happens here."""

    async def probe(self, publisher: WeightPublisher, published: dict, version: int, model_config) -> None:
        """Fault injection: what a deposed leader publishes next as `version` (a keyframe of `published`)."""
        await publisher.publish_keyframe(published, version, model_config, set_version=False)


class GatheredEncoder(VersionEncoder):
    def start(self) -> None:
        pass  # the base is the state the leader holds as published, handed to `take`

    async def take(self, published: dict, live: bool, version: int, stats: dict) -> Taken:
        new = await asyncio.to_thread(self.learner.publication.published_state)
        return TakenState(
            published,
            new,
            version - 1,
            version,
            live,
            keyframe=self.keyframe_due(version),
            context=self.cfg.use_delta_context,
        )


class ShardedEncoder(VersionEncoder):
    def __init__(self, cfg: TrainerConfig, learner):
        super().__init__(cfg, learner)
        self.last: ShardedVersion | None = None  # the last version encoded (the deposed probe's parts)

    def start(self) -> None:
        self.learner.publication.mark_published()  # every rank's rows now: the base of its next part

    def needs_full_state(self, live: bool, version: int) -> bool:
        """Sharded publication still gathers the whole state for a keyframe or an evaluation."""
        cfg = self.cfg
        return (live and self.keyframe_due(version)) or bool(
            cfg.tasks.eval_every and version % cfg.tasks.eval_every == 0
        )

    async def take(self, published: dict, live: bool, version: int, stats: dict) -> Taken:
        parts = None
        if live:  # parts now (a collective: not while the next step runs)
            te = time.perf_counter()
            parts = await asyncio.to_thread(self.learner.publication.publish_parts, version - 1, version)
            stats["encode_s"] = time.perf_counter() - te  # this rank's part (each codes its own)
        new = None
        if self.needs_full_state(live, version):
            new = await asyncio.to_thread(self.learner.publication.published_state)
        if parts is None:
            return TakenParts(None, new)
        keyframe = new if self.keyframe_due(version) else None
        self.last = ShardedVersion.of(parts, version - 1, version, keyframe=keyframe)
        return TakenParts(self.last, new)

    async def probe(self, publisher: WeightPublisher, published: dict, version: int, model_config) -> None:
        """A manifest of the last parts as `version`, or a keyframe before any version was encoded."""
        if self.last is None:
            return await super().probe(publisher, published, version, model_config)
        await publish_sharded(
            publisher,
            self.last.parts,
            from_version=version - 1,
            to_version=version,
            model_config=model_config,
            set_version=False,
        )


def make_encoder(cfg: TrainerConfig, learner) -> VersionEncoder:
    """The encoder of `[trainer.publish] layout`, chosen once."""
    return ShardedEncoder(cfg, learner) if cfg.publish.layout == "sharded" else GatheredEncoder(cfg, learner)
