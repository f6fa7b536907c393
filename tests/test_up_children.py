"""What `asyncrl up` starts each child with: the user's table between the run's defaults (which
the table overrides) and the run's facts (which it cannot), and every table builds the typed
config its process would."""

from pathlib import Path

from asyncrl import children, config_check, thread_plan
from kernel.config import load_config
from rollout_worker.config import WorkerConfig
from scorer.config import ScorerConfig
from trainer.config import TrainerConfig

CONF = {
    "up": {"workers": 2, "scorers": 1},
    "trainer": {"run": {"grace_s": 3.0, "dir": "/somewhere/else"}, "batch": {"max_lag": 4}},
    "worker": {"episodes": {"envs": ["arith"]}, "admission": {"max_lag": 4}, "bus": {"name": "mine"}},
    "scorer": {"sandbox": {"envs": ["arith", "code"]}},
}


def facts(tmp_path: Path, sync: bool = False, token: str | None = None) -> children.RunFacts:
    threads = thread_plan.plan(CONF, 2, 1, cpus=4)
    return children.RunFacts(tmp_path, ["nats://127.0.0.1:4222"], 3, 7.5, sync, threads, token)


def test_the_users_keys_win_over_defaults_and_the_runs_facts_over_both(tmp_path):
    t = children.tables(CONF, config_check.resolve(CONF, environ={}), facts(tmp_path))
    assert t["trainer"]["run"]["grace_s"] == 3.0  # the file's own grace
    assert t["worker"]["run"]["grace_s"] == t["scorer"]["run"]["grace_s"] == 7.5  # the run's default
    assert t["trainer"]["run"]["dir"] == str(tmp_path)  # the run's folder, whatever the file said
    assert t["trainer"]["checkpoint"]["dir"] == str(tmp_path / "checkpoints")
    assert t["trainer"]["batch"]["max_lag"] == t["worker"]["admission"]["max_lag"] == 4
    assert t["scorer"]["sandbox"]["envs"] == ["arith", "code"]  # the file's list, not the run's
    for table in t.values():  # the bus table is the run's, whole: no stray key of the file's
        assert table["bus"] == {"servers": ["nats://127.0.0.1:4222"], "topology": {"weights_keep": 3}}
    assert "harness" not in t["worker"]


def test_a_sync_run_forces_max_lag_0_and_hands_out_the_token_file(tmp_path):
    t = children.tables(CONF, config_check.resolve(CONF, environ={}), facts(tmp_path, True, "/run/tok"))
    assert t["trainer"]["batch"]["max_lag"] == t["worker"]["admission"]["max_lag"] == 0
    assert t["trainer"]["run"]["mode"] == "sync"
    assert t["worker"]["harness"] == {"endpoint_token_file": "/run/tok"}


def test_each_child_has_its_own_id_and_seed_and_builds_its_typed_config(tmp_path):
    t = children.tables(CONF, config_check.resolve(CONF, environ={}), facts(tmp_path))
    threads = thread_plan.plan(CONF, 2, 1, cpus=4)
    specs = children.specs(t, trainers=2, scorers=1, workers=2, threads=threads, worker_nice=5)
    assert [s.name for s in specs] == ["trainer", "trainer-standby-1", "scorer-0", "worker-0", "worker-1"]
    assert [s.conf.get("engine", {}).get("seed") for s in specs[3:]] == [1000, 1001]
    assert {s.nice for s in specs[3:]} == {5} and {s.nice for s in specs[:3]} == {0}
    cls = {"trainer": TrainerConfig, "scorer": ScorerConfig, "rollout_worker": WorkerConfig}
    built = [load_config(cls[s.component], None, overrides=s.conf, environ={}) for s in specs]
    assert [built[0].trainer_id, built[1].trainer_id] == ["trainer", "trainer-standby-1"]
    assert built[2].scorer_id == "scorer-0" and [b.worker_id for b in built[3:]] == ["worker-0", "worker-1"]
    assert built[3].run.threads == threads.worker and built[0].run.dir == str(tmp_path)
    assert t["worker"] is not specs[3].conf and "worker_id" not in t["worker"]  # the table is not shared
