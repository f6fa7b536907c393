"""Every chaos scenario by the name bench.chaos and its --only flag know it, in run order.
Add a scenario here with one line (see the package docstring)."""

from __future__ import annotations

from .scenarios_bus import bad_input, cluster_node_loss, forged_weights, restart_nats
from .scenarios_fleet import random_kill_storm, up_supervisor
from .scenarios_poison import poison_numbers
from .scenarios_rank_kill import trainer_rank_kill
from .scenarios_trainer import (
    background_checkpoint_kill,
    deferred_checkpoint_kill,
    deposed_leader_publish,
    leader_failover,
    slow_step_kill,
    sync_poison_task,
)
from .scenarios_workers import backlog, kill_scorer, kill_workers, pause_worker, worker_feed_crash

SCENARIOS = {
    "worker_sigkill": kill_workers,
    "scorer_sigkill": kill_scorer,
    "trainer_leader": leader_failover,
    "nats_restart": restart_nats,
    "cluster_node_sigkill": cluster_node_loss,
    "worker_sigstop": pause_worker,
    "bad_input_dlq": bad_input,
    "backlog_10k": backlog,
    "slow_step_kill": slow_step_kill,
    "deferred_checkpoint_kill": deferred_checkpoint_kill,
    "background_checkpoint_kill": background_checkpoint_kill,
    "sync_poison_task": sync_poison_task,
    "random_kill_storm": random_kill_storm,
    "forged_weights": forged_weights,
    "deposed_leader_publish": deposed_leader_publish,
    "worker_feed_crash": worker_feed_crash,
    "up_supervisor": up_supervisor,
    "trainer_rank_kill": trainer_rank_kill,
    "poison_numbers": poison_numbers,
}
