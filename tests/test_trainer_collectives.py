"""The registry of collectives (trainer/commands.py): what rank 0 sends is a registered, typed
command or a clear error, and every collective the trainer defines runs, both as rank 0 runs it
(`collective`) and as a follower does (`follow`, fed rank 0's wire copy), on a sharded model in a
1-process gloo group (FSDP2 over a 1-rank mesh: the sharded branches, without a second process).
The 2-rank runs are tests/test_trainer_fsdp*.py, test_trainer_sharded_publish.py, test_trainer_dist.py."""

from __future__ import annotations

import dataclasses
import pickle
import typing
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from tests.helpers.fsdp import cfg_dict, make_samples
from trainer.checkpoint_state import LoadShards, SaveShards
from trainer.commands import Collective, CommandError, check, collective, follow, name_of, registered
from trainer.config import TrainerConfig
from trainer.dist import Stop, Sync
from trainer.factory import build_learner, build_optimizer, device, initial_model
from trainer.fsdp import is_sharded, shard
from trainer.learner import Learner, Step
from trainer.loss import LossConfig
from trainer.published import (
    GatherFp32,
    GatherPublished,
    GatherState,
    MarkPublished,
    Publication,
    PublishParts,
)
from trainer.warmstart import AnchorReference, WarmStart


@dataclass(frozen=True)
class Echo(Collective[str], on=Publication):
    """A collective of this test's own: registered by being defined."""

    word: str
    times: int = 1

    def run(self, pub: Publication) -> str:
        return self.word * self.times


@dataclass
class Loose(Collective[None], on=Publication):  # not frozen: refused when checked
    x: int = 0

    def run(self, pub: Publication) -> None:
        return None


class NotACommand:
    pass


# -- the registry, no process group -------------------------------------------------------------------


def test_unknown_commands_are_refused_with_the_registered_names():
    for cmd in (("step", []), ("call", "published_state", ()), NotACommand(), None, "stop"):
        with pytest.raises(CommandError, match="not a registered collective.*trainer.learner.Step"):
            check(cmd)


def test_a_look_alike_of_a_registered_class_is_refused():
    # the module and name of a registered collective, but not that class
    fake = type("Step", (), {"__module__": "trainer.learner", "samples": []})()
    with pytest.raises(CommandError, match="not a registered collective: trainer.learner.Step"):
        check(fake)


def test_ill_typed_arguments_are_refused_naming_the_field():
    with pytest.raises(CommandError, match=r"PublishParts\.from_version: expected <class 'int'>, got str"):
        check(PublishParts("0", 1))
    with pytest.raises(CommandError, match=r"Step\.samples"):
        check(Step([1, 2]))  # list elements are checked too
    with pytest.raises(CommandError, match=r"SaveShards\.epoch"):
        check(SaveShards("d", 1.5, 2))
    with pytest.raises(CommandError, match=r"LoadShards\.model_state"):
        check(LoadShards("d", ["not", "a", "dict"], None))
    with pytest.raises(CommandError, match=r"WarmStart\.cfg"):
        check(WarmStart({"warmstart": {}}, None))
    with pytest.raises(CommandError, match=r"Echo\.times"):
        check(Echo("a", "2"))
    with pytest.raises(CommandError, match="not a frozen dataclass"):
        check(Loose())
    # well-typed ones pass as they are (an int where a float is asked would too)
    assert check(Echo("ab", 2)) == Echo("ab", 2)
    assert check(LoadShards("d", None, None)) and check(Step(make_samples(2)))


def test_rank0_checks_before_it_runs_or_sends_and_runs_on_the_declared_class():
    pub = Publication(torch.nn.Linear(2, 2))
    assert collective(Echo("ab", 2), pub) == "abab"
    with pytest.raises(CommandError, match="Echo.times"):
        collective(Echo("ab", "2"), pub)
    with pytest.raises(CommandError, match="runs on a Publication, not a Linear"):
        collective(Echo("ab"), torch.nn.Linear(2, 2))


def test_follow_runs_each_command_on_its_class_until_a_last_one():
    model = torch.nn.Linear(2, 2)
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.0), LossConfig())
    pub = Publication(model)
    seen = []
    feed = iter([Echo("x"), MarkPublished(), Stop(), Echo("never")])

    def receive():
        cmd = next(feed)
        seen.append(type(cmd).__name__)
        return pickle.loads(pickle.dumps(cmd))  # as broadcast_object_list delivers it

    follow([learner, learner.checkpoint, pub], receive=receive)
    assert seen == ["Echo", "MarkPublished", "Stop"] and pub.rows_base is not None
    with pytest.raises(CommandError, match="not a registered collective"):
        follow([learner], receive=iter([("step", [])]).__next__)
    with pytest.raises(CommandError, match="runs on a CheckpointState: this rank holds none"):
        follow([learner.publication], receive=iter([SaveShards("d", 1, 1)]).__next__)


def test_what_the_other_ranks_receive_leaves_rank0s_own_data_out():
    cfg = TrainerConfig()
    ws = WarmStart(cfg, None, "default", on_check=print)
    assert ws.wire().on_check is None and ws.wire().cfg is cfg and ws.on_check is print
    dcp = {"__dcp__": "shards-e00000001-v00000002", "optim": True}
    assert LoadShards("d", dcp, {"state": {}}).wire() == LoadShards("d", dcp, None)
    whole = {"w": torch.zeros(2)}
    assert LoadShards("d", whole, {"state": {}}).wire() == LoadShards("d", None, None)


# -- every collective the trainer defines, on a 1-process group --------------------------------------


@pytest.fixture
def group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded_learner(tmp_path) -> tuple[Learner, TrainerConfig]:
    cfg = TrainerConfig(
        **cfg_dict(
            tmp_path,
            loss={"kl_coef": 0.1, "micro_batch": 4},
            policy={"activation_checkpointing": False},
            warmstart={"steps": 1, "batch": 2},
        )
    )
    model, _ = initial_model(cfg)
    ref, _ = initial_model(cfg)
    ref.requires_grad_(False).eval()
    shard(model, device(cfg))
    shard(ref, device(cfg))
    learner = build_learner(model, build_optimizer(model, cfg), cfg, reference=ref)
    assert is_sharded(learner.model) and is_sharded(learner.reference)
    return learner, cfg


_SHARDS = "shards-e00000001-v00000001"


def _examples(learner: Learner, cfg: TrainerConfig, ckpt_dir: str) -> list[tuple[Collective, object]]:
    """One command of every collective the trainer defines, with the object it runs on, in an
    order that works (mark before parts, save before load); Stop last."""
    mcfg = learner.model.cfg
    return [
        (Sync(), learner),
        (Step(make_samples(5)), learner),
        (WarmStart(cfg, mcfg, "default"), learner),
        (AnchorReference(), learner),
        (MarkPublished(), learner.publication),
        (Step(make_samples(5, seed=1)), learner),
        (PublishParts(0, 1), learner.publication),
        (GatherPublished(), learner.publication),
        (GatherFp32(), learner.publication),
        (GatherState(), learner.publication),
        (SaveShards(ckpt_dir, 1, 1), learner.checkpoint),
        (
            LoadShards(ckpt_dir, {"__dcp__": "shards-e00000001-v00000001", "optim": True}, None),
            learner.checkpoint,
        ),
        (Stop(), learner),
    ]


def test_the_examples_cover_every_registered_collective(tmp_path):
    """A new collective must be added to _examples (and so run below)."""
    ours = {n for n in registered() if n.startswith("trainer.")}
    cfg = TrainerConfig(**cfg_dict(tmp_path, loss={"kl_coef": 0.0}))
    model, _ = initial_model(cfg)  # only the commands' classes are looked at: no group, no shards
    covered = {
        name_of(type(c))
        for c, _ in _examples(build_learner(model, build_optimizer(model, cfg), cfg), cfg, "d")
    }
    assert covered == ours


def test_every_collective_runs_as_rank0_and_as_a_follower_on_a_1_process_group(group, tmp_path):
    learner, cfg = _sharded_learner(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    results = {}
    for cmd, target in _examples(learner, cfg, ckpt):  # rank 0: collective() runs it here
        results[type(cmd).__name__] = collective(cmd, target)
        if isinstance(cmd, AnchorReference):  # after a step's reference forward (root left unsharded)
            ref = dict(learner.reference.named_parameters())
            for n, p in learner.model.named_parameters():
                assert torch.equal(ref[n].full_tensor(), p.full_tensor()), n
    assert "skipped" not in results["Step"] and len(results["WarmStart"]) == 1
    assert len(results["PublishParts"]) == 1 and isinstance(results["PublishParts"][0], bytes)
    assert results["SaveShards"]["model"]["__dcp__"] == "shards-e00000001-v00000001"
    for name in ("GatherPublished", "GatherFp32", "GatherState"):
        assert results[name] and all(isinstance(v, torch.Tensor) for v in results[name].values()), name
    assert all(v.dtype == torch.bfloat16 for v in results["GatherPublished"].values())
    # the followers' path: each command's wire copy, pickled, dispatched on the learner's parts
    ckpt2 = str(tmp_path / "ckpt2")
    sent = [pickle.loads(pickle.dumps(check(c.wire()))) for c, _ in _examples(learner, cfg, ckpt2)]
    feed = iter(sent)
    follow([learner, learner.checkpoint, learner.publication], receive=lambda: next(feed))
    assert next(feed, None) is None  # every one ran, Stop last
    assert (tmp_path / "ckpt2" / "shards-e00000001-v00000001" / ".metadata").is_file()


def test_every_trainer_collective_is_a_frozen_dataclass_with_resolvable_types():
    for name, cls in registered().items():
        if name.startswith("trainer."):
            assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
            hints = typing.get_type_hints(cls)  # what check() resolves: every annotation names a type
            assert {f.name for f in dataclasses.fields(cls)} <= set(hints), name
