"""`python -m trainer`: the asynchronous learner (leader, trainer/leader.py) or a standby waiting to
take over; with torchrun, ranks > 0 run rank 0's collectives (trainer/commands.py, trainer/dist.py)."""

from __future__ import annotations

import asyncio
import os
import sys
from types import SimpleNamespace

import click

from bus import RETRYABLE, BlobError, PublishError, connect
from kernel import get_logger, load_config, setup_logging
from kernel.cli import Command, parse
from kernel.cli import run as run_cli
from kernel.config import run_section
from kernel.lifetime import stop_on_signals
from kernel.metrics import serve_metrics
from policy.devices import device_env

from .commands import world
from .config import TrainerConfig
from .dist import end_rank_process, follower_loop, init_distributed, shutdown_distributed, stop_followers
from .factory import build_learner, build_model, build_optimizer, device
from .leader import Trainer

log = get_logger("trainer")


async def run(cfg: TrainerConfig, stop: asyncio.Event | None = None) -> int:
    stop = stop or asyncio.Event()
    init_distributed()
    rank, ws = world()
    model, mcfg = build_model(cfg)
    opt = build_optimizer(model, cfg)
    learner = build_learner(model, opt, cfg)
    log.info("devices", **device_env(), device=str(device(cfg)))  # each rank: where it runs ([layout])
    if rank > 0:
        await follower_loop(learner)  # a peer's death raises here: exit non-zero, the agent restarts us
        shutdown_distributed()
        return 0
    cfg.bus.name = cfg.trainer_id
    bus = await connect(cfg.bus)
    clean = False
    try:
        await bus.provision()
        while True:  # a deposed leader goes back to standby (and resumes from the checkpoint)
            try:
                code = await Trainer(cfg, bus, learner, mcfg).lead(stop)
            except (
                *RETRYABLE,
                PublishError,
                BlobError,
            ) as e:  # bus trouble: lease released, retry as standby
                log.error("bus failure while leading; back to standby", error=f"{type(e).__name__}: {e}")
                code = 3
            if code != 3 or stop.is_set():
                clean = True
                return code
            log.warning("lost the leader lease; back to standby")
    finally:
        # a failed collective (a peer died: torchrun's agent re-forms the group) leaves the group
        # unusable: no goodbye to the followers, just exit non-zero and let the agent restart us
        if ws > 1 and clean:
            stop_followers(learner)
            shutdown_distributed()
        await bus.close()


@click.command("trainer", cls=Command, help="asyncrl trainer (leader or standby)")
@click.option("--config", help="TOML file: a run TOML (its [trainer] table) or the trainer's own keys")
@click.option("--section", default="trainer")
@click.option("--sync", is_flag=True, help="synchronous baseline: one task batch per version")
@click.option("--max-steps", type=int)
@click.option("--id", help="trainer id (lease holder name)")
@click.option(
    "--eval-final",
    is_flag=True,
    help="evaluate the newest checkpoint in [trainer.checkpoint] dir on the eval split and "
    "exit (no bus; `asyncrl up` runs it after a run with [up] final_eval)",
)
@click.option(
    "--eval-initial",
    is_flag=True,
    help="evaluate the policy the run started from ([trainer.run] dir/warmstart.pt, else the "
    "initial model) unless the run evaluated version 0, and exit (no bus; [up] final_eval)",
)
@click.option(
    "--elastic",
    is_flag=True,
    help="run this node's torchrun elastic agent ([trainer.elastic]) instead: see docs/trainer.md",
)
def cli(**flags) -> int:
    return start(SimpleNamespace(**flags))


def config_of(a: SimpleNamespace) -> TrainerConfig:
    """Config from --config (a run TOML's [trainer] table, else the whole file), env, flags."""
    section = run_section(a.config, a.section)
    over: dict = {}
    if a.sync:
        over.setdefault("run", {})["mode"] = "sync"
    if a.max_steps is not None:
        over.setdefault("run", {})["max_steps"] = a.max_steps
    if a.id:
        over["trainer_id"] = a.id
    return load_config(TrainerConfig, a.config, section=section, overrides=over, table=a.section)


def load(argv=None) -> TrainerConfig:
    """The config `python -m trainer <argv>` runs with."""
    return config_of(parse(cli, argv, "trainer"))


def rank_argv(a: SimpleNamespace) -> list[str]:
    """The flags again, less --elastic: each rank the elastic agent starts runs the plain trainer."""
    out = ["--config", a.config] if a.config else []
    out += ["--section", a.section] if a.section != "trainer" else []
    out += ["--sync"] if a.sync else []
    out += ["--max-steps", str(a.max_steps)] if a.max_steps is not None else []
    out += ["--id", a.id] if a.id else []
    return out + ["--eval-final"] * a.eval_final + ["--eval-initial"] * a.eval_initial


def main(argv=None) -> int:
    return run_cli(cli, argv, "trainer")


def start(a: SimpleNamespace) -> int:
    try:
        cfg = config_of(a)
    except ValueError as e:  # ConfigError included: a clear message, no traceback
        print(f"trainer: bad configuration: {e}", file=sys.stderr)
        return 2
    if a.elastic:  # become this node's elastic agent; its workers run us without the flag
        from .elastic import agent_env, torchrun_argv

        cmd = torchrun_argv(cfg, rank_argv(a))
        sys.stdout.flush()
        os.execve(cmd[0], cmd, agent_env(dict(os.environ)))
    if cfg.run.threads:  # before any torch work: the step, evals and encode run on these
        import torch

        torch.set_num_threads(cfg.run.threads)
    setup_logging("trainer", component_id=cfg.trainer_id)
    if a.eval_final or a.eval_initial:
        from .checkpoint import CheckpointError
        from .final_eval import FinalEvalError, evaluate_checkpoint, evaluate_initial

        which = "final" if a.eval_final else "initial"
        try:
            row = (evaluate_checkpoint if which == "final" else evaluate_initial)(cfg)
        except (FinalEvalError, CheckpointError, OSError, ValueError) as e:
            log.error(f"{which} eval failed", error=str(e))
            return 1
        log.info(f"{which} eval", **(row or {"skipped": "the run already evaluated that version"}))
        return 0
    if int(os.environ.get("RANK", "0")) == 0:  # a trainer group: /metrics from rank 0 (on the bus)
        serve_metrics(cfg.run)

    async def _main() -> int:
        stop = asyncio.Event()
        # SIGTERM/SIGINT/SIGHUP: stop, and a hard exit after grace_s even if the broker is gone
        stop_on_signals(stop, cfg.run.grace_s, name=cfg.trainer_id)
        return await run(cfg, stop)

    code = asyncio.run(_main())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun rank: see end_rank_process
        end_rank_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
