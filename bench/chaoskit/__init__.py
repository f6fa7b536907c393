"""Fault-injection harness: real trainer / scorer / worker processes on a real nats-server,
faults injected with signals, and the books kept from what the processes themselves wrote.
bench.chaos runs every scenario; tests/test_chaos_*.py run them one by one.

    params.py            sizes and timings of every run (model, group size, ack_wait, lease TTL)
    fleet.py             the processes: spawn, signal, feed tasks, wait on versions and consumers
    books.py             lost / trained twice / dropped, from the trainers' step lines; report row
    streams.py           what the broker stored: WEIGHTS history, DLQ entries, stored rollouts
    observe.py           version line (gaps, forks), leader lease, first version after a death, logs
    nats_configs.py      the shipped deploy/nats configs run on one machine (the R3 cluster)
    scenarios_workers.py worker / scorer faults     scenarios_trainer.py  leader faults
    scenarios_bus.py     broker and bad traffic     scenarios_fleet.py    kill storm, `asyncrl up`
    scenarios_poison.py  bad numbers in every event field and a signed NaN delta (poison_numbers)
    registry.py          SCENARIOS: name -> scenario function, the one list bench.chaos runs

Every scenario is `async def name(run_dir: Path, tasks: int = N, seed: int = S, ...) -> dict`
(or a list of dicts for several rows): it starts its own server and Fleet, injects its fault,
and returns `books.row(name, fleet.books(ids), recovery_s, passed, **extra)`, bounded in time.

Adding a scenario (e.g. `trainer_rank_kill`): write `async def rank_kill(run_dir, tasks=..., seed=...)`
in the scenarios_<target>.py module of what it faults (or a new scenarios_<target>.py), add
`"trainer_rank_kill": rank_kill,` (and its import) to registry.py, and a test in tests/test_chaos_*.py
(long: @pytest.mark.chaos; a short version in the default suite). `python -m bench.chaos --only
trainer_rank_kill` then runs it (its --tasks goes to `tasks=`; backlog_10k keeps its own size).
"""
