"""The trainer group under torchrun's elastic agent: spare-node swap.

One agent per node (`python -m trainer --elastic --config X` on each, or the torchrun line
`torchrun_argv` builds), c10d rendezvous, `--nnodes=MIN:MAX`, `--max_restarts`. An agent that
arrives when the group already has MAX nodes waits as a spare (the rendezvous' redundancy list).
When a rank dies, every surviving rank's next collective fails, each agent stops its workers and
the agents rendezvous again; the spare takes the dead node's place if that node is gone for good.
The re-formed group is a fresh set of processes: its rank 0 acquires the leader lease like any
standby (at once when the old rank 0 released it, after the TTL when it was killed), with a new,
higher epoch, resumes from the newest complete sharded checkpoint (DCP reshards to the new world)
and announces that version with a keyframe; the batch in flight was never acked and its rollout
ids are deduplicated against the checkpoint's consumed ids, so nothing is trained twice."""

from __future__ import annotations

import sys

from .config import TrainerConfig


def torchrun_argv(cfg: TrainerConfig, trainer_args: list[str], python: str = sys.executable) -> list[str]:
    """The command line of one node's elastic agent running `python -m trainer <trainer_args>`."""
    argv = [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={cfg.elastic.nnodes}",
        f"--nproc_per_node={cfg.elastic.nproc_per_node}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={cfg.elastic.rdzv_endpoint}",
        f"--rdzv_id={cfg.elastic.rdzv_id}",
        f"--max_restarts={cfg.elastic.max_restarts}",
    ]
    # who hosts the store is explicit: inferred from the endpoint, every agent on one host (or
    # behind one name) would race for it, and the store dies with whichever node won
    conf = ",".join(x for x in (f"is_host={int(cfg.elastic.rdzv_host)}", cfg.elastic.rdzv_conf) if x)
    argv.append(f"--rdzv_conf={conf}")
    return argv + ["-m", "trainer", *trainer_args]


def agent_env(environ: dict) -> dict:
    """The agent's environment. torch shares one TCP store per group between the rendezvous and
    the workers by default, and a node that joins later as rank > 0 (the spare) then waits forever
    for a store address that the rank-0 node, rank 0 in the round before too, never publishes
    again: the swap hangs. Without sharing, every round publishes its workers' store afresh."""
    return {**environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
