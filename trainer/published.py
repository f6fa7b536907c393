"""What the trainer's weights look like from outside, gathered on rank 0, and its collectives.

- the published state: the bf16 bits the workers will hold (`published_state`), whose digest the
  checkpoint records and whose delta the leader publishes;
- sharded publication: each rank's encoded delta of the rows it owns (`mark_published`, then
  `publish_parts` per version; trainer/publish_shards.py does the encoding);
- whole states for the run's files and tests: the fp32 master weights (`full_fp32`) and the model
  state dict (`full_state`, warmstart.pt).

One process: plain reads of the model. A sharded (FSDP2) model: each is a collective (all-gathers,
a gather of the parts), issued by rank 0 (trainer/commands.py) so that every rank runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from policy import inference_state

from .commands import Collective, collective, world
from .fsdp import full_tensor, is_sharded


class NonFiniteWeights(RuntimeError):
    """A version whose bf16 weights hold a non-finite element: never encoded, checkpointed or published."""


def check_finite_state(state: dict[str, torch.Tensor], version: int) -> None:
    """Raise NonFiniteWeights unless every element of every tensor (the bf16 bits) is finite."""
    bad = [k for k, t in state.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise NonFiniteWeights(
            f"version {version}: non-finite weights in {len(bad)} tensors ({bad[:3]}): refusing to publish"
        )


class Publication:
    """This rank's model as the workers see it, and (sharded publication) the rows of its last part."""

    def __init__(self, model, delta_context: bool = False):
        self.model, self.delta_context = model, delta_context
        self.rows_base: dict[str, torch.Tensor] | None = None  # this rank's rows at the last part

    def published_state(self) -> dict[str, torch.Tensor] | None:
        """The bf16 bits workers will hold (on the CPU: the codec and the bus work there). Sharded:
        a collective that gathers each parameter; rank 0 gets the dict, the others None."""
        if not is_sharded(self.model):
            return {k: v.cpu() for k, v in inference_state(self.model, dtype=torch.bfloat16).items()}
        return collective(GatherPublished(), self)

    def full_fp32(self) -> dict[str, torch.Tensor] | None:
        """The fp32 master weights gathered on rank 0 (a collective when sharded; tests, export)."""
        if not is_sharded(self.model):
            return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}
        return collective(GatherFp32(), self)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model state dict on rank 0 (a collective when sharded; others get None)."""
        if not is_sharded(self.model):
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return collective(GatherState(), self)

    def mark_published(self) -> None:
        """Every rank remembers its bf16 rows as the base of its next sharded part (no communication)."""
        collective(MarkPublished(), self)

    def publish_parts(self, from_version: int, to_version: int) -> list[bytes] | None:
        """Sharded publication: every rank encodes the delta of its own rows since mark_published /
        the last part; rank 0 gets all parts in rank order, the others None. Only the encoded
        parts travel (gather_object), never the weights."""
        if self.rows_base is None:
            raise RuntimeError("publish_parts before mark_published: no base rows")
        return collective(PublishParts(from_version, to_version), self)


@dataclass(frozen=True)
class GatherPublished(Collective[dict | None], on=Publication):
    """Every rank all-gathers each parameter in bf16; rank 0 keeps them (the others get None)."""

    def run(self, pub: Publication) -> dict[str, torch.Tensor] | None:
        out = {}
        with torch.no_grad():
            for n, p in pub.model.named_parameters():
                full = full_tensor(p.detach()).to(torch.bfloat16).cpu()
                if world()[0] == 0:
                    out[n] = full
        return out if world()[0] == 0 else None


@dataclass(frozen=True)
class GatherFp32(Collective[dict | None], on=Publication):
    """Every rank all-gathers each fp32 master parameter; rank 0 keeps them."""

    def run(self, pub: Publication) -> dict[str, torch.Tensor] | None:
        out = {n: full_tensor(p.detach()).cpu() for n, p in pub.model.named_parameters()}
        return out if world()[0] == 0 else None


@dataclass(frozen=True)
class GatherState(Collective[dict | None], on=Publication):
    """The full model state dict (torch.distributed.checkpoint.state_dict), on rank 0's CPU."""

    def run(self, pub: Publication) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(pub.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if world()[0] == 0 else None


@dataclass(frozen=True)
class MarkPublished(Collective[None], on=Publication):
    """Every rank keeps its own bf16 rows as the base of its next part."""

    def run(self, pub: Publication) -> None:
        from .publish_shards import local_rows

        pub.rows_base = local_rows(pub.model)[0]


@dataclass(frozen=True)
class PublishParts(Collective[list | None], on=Publication):
    """Every rank checks and encodes its rows' delta from_version -> to_version; rank 0 gathers
    the parts in rank order. A non-finite weight on any rank: every rank refuses together (the
    count is all-reduced first, so nobody waits alone in the gather)."""

    from_version: int
    to_version: int

    def run(self, pub: Publication) -> list[bytes] | None:
        from .publish_shards import encode_local_part

        if pub.rows_base is None:
            raise RuntimeError("publish_parts before mark_published: no base rows")
        model = pub.model
        with torch.no_grad():
            local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
            bad = torch.tensor(
                [sum(int((~torch.isfinite(t.to(torch.bfloat16))).sum()) for t in local)], dtype=torch.float64
            )
        if is_sharded(model):
            bad = bad.to(next(model.parameters()).device)
            dist.all_reduce(bad, op=dist.ReduceOp.SUM)
        if float(bad.sum()) > 0:
            raise NonFiniteWeights(
                f"version {self.to_version}: {int(bad.sum())} non-finite weights: refusing to publish"
            )
        part, pub.rows_base = encode_local_part(
            model, pub.rows_base, self.from_version, self.to_version, context=pub.delta_context
        )
        if not is_sharded(model):
            return [part]
        box = [None] * world()[1] if world()[0] == 0 else None
        dist.gather_object(part, box, dst=0)
        return box
