"""`torchrun --nproc_per_node 2 -m trainer` (FSDP2 on gloo, only rank 0 on the bus) reaches the same
weights as one process on the same batch; its checkpoint is sharded (torch.distributed.checkpoint)
and loads in one process."""

from pathlib import Path

import torch

from asyncrl.launch import write_toml
from tests.helpers.fsdp import launch
from tests.helpers.tolerance import assert_adam_close, grad_reduction_len
from tests.helpers.trainer import publish_groups, trainer_config
from trainer import checkpoint
from trainer.batcher import Batcher, ConsumedIds
from trainer.factory import build_learner, build_model, build_optimizer
from trainer.learner import pack

ROOT = Path(__file__).resolve().parents[1]


async def test_two_process_gloo_matches_one_process(bus, fresh_server, tmp_path):
    cfg = trainer_config(
        fresh_server.url, tmp_path, run={"max_steps": 1}, batch={"groups": 2, "group_size": 3}
    )
    model, mcfg = build_model(cfg)
    await publish_groups(bus, model, 2, 3, seed=3)
    probe = Batcher(bus, cfg, ConsumedIds(), mcfg.vocab_size)
    await probe.start()
    batch = await probe.next_batch(0)
    packed = pack(batch)
    for s in batch.samples:
        await s.msg.nak()
    # reference: one process, same initial weights, same batch
    lr = build_learner(model, build_optimizer(model, cfg), cfg).step(packed)["lr"]

    conf = tmp_path / "t.toml"
    write_toml(
        conf,
        {
            "trainer": {
                "trainer_id": "ddp",
                "policy": {"model": {k: v for k, v in cfg.policy.model.items() if v is not None}},
                "batch": {"groups": 2, "group_size": 3, "fetch_timeout_s": 0.2},
                "tasks": {"feed": False},
                "optim": {"lr": cfg.optim.lr},
                "run": {"max_steps": 1},
                "checkpoint": {"dir": str(cfg.checkpoint.dir)},
                "bus": {"servers": [fresh_server.url]},
            }
        },
    )
    out = launch(["-m", "trainer", "--config", str(conf)], timeout_s=240)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    st = checkpoint.load_latest(cfg.checkpoint.dir)
    assert st.version == 1 and "__dcp__" in st.model  # written by both ranks
    loaded, _ = build_model(cfg)
    build_learner(loaded, build_optimizer(loaded, cfg), cfg).checkpoint.load(
        cfg.checkpoint.dir, st.model, st.optimizer
    )
    # why: 2 ranks sum the gradients in another order than one process: AdamW's bound for one step
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in packed)
    assert_adam_close(
        loaded.state_dict(),
        model.state_dict(),
        lrs=[lr],
        betas=tuple(cfg.optim.betas),
        reduction_len=grad_reduction_len(mcfg, tokens),
    )
    init, _ = build_model(cfg)
    assert any(
        not torch.equal(v, init.state_dict()[k]) for k, v in loaded.state_dict().items()
    )  # it did train
    # the digest recorded in the checkpoint is the one of the bf16 state gathered from the shards
    import delta_codec
    from policy import inference_state

    assert st.digest == delta_codec.state_digest(inference_state(loaded))
