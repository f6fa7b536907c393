"""`asyncrl up` end to end: real nats-server, trainer, 2 workers and a scorer as OS processes."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

from asyncrl.report import read_jsonl
from bench.up_driver import SMALL_RUN
from bus import BusConfig, connect
from bus import topology as topo
from bus.events import decode
from delta_codec import signing

# bench/up_driver.py's run (shared with the chaos harness's up_supervisor), with no eval in the run:
# the after-run evals ([up] final_eval) measure the warm start (v0) and the version the run ended at
CONFIG = SMALL_RUN.replace("eval_every = 3", "eval_every = 0").replace("[up]\n", "[up]\nfinal_eval = true\n")


async def test_up_short_run(fresh_server, tmp_path):
    cfg = tmp_path / "up.toml"
    cfg.write_text(CONFIG)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "up",
            "--config",
            str(cfg),
            "--steps",
            "10",
            "--minutes",
            "4",
            "--nats",
            fresh_server.url,
            "--run-dir",
            str(run_dir),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["versions"] >= 10

    rows = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    steps = [r for r in rows if "samples" in r]
    # versions advanced one per step, without gap
    live = [r["version"] for r in steps if r["live_samples"]]
    assert live == list(range(1, len(live) + 1))
    # nothing trained twice; trained rollouts form complete groups of group_size (task_id-i)
    ids = [rid for r in steps for rid in r["rollout_ids"]]
    assert len(ids) == len(set(ids)) and ids
    groups = collections.Counter(rid.rsplit("-", 1)[0] for rid in ids)
    assert set(groups.values()) == {4}, groups
    # in-flight updates: some trajectories were generated across two or more policy versions
    assert sum(r["multi_version_samples"] for r in steps) > 0
    # after the run, side by side: the eval of the initial policy and of the last checkpoint (the
    # version the run ended at), in either order; the summary reports them by version
    evals = sorted((r for r in rows if "eval_success" in r), key=lambda r: r["version"])
    assert [r["version"] for r in evals] == [0, summary["versions"]]
    assert evals[0].get("eval_initial") and evals[-1].get("eval_final")
    assert summary["final_eval"] == "done" and summary["eval_success_final"] == evals[-1]["eval_success"]
    assert summary["eval_success_initial"] == evals[0]["eval_success"]
    assert summary["eval_version_final"] == summary["versions"]
    # every component wrote metrics and logs; plots exist
    assert (run_dir / "plots" / "run.png").stat().st_size > 10_000
    assert len(list((run_dir / "metrics").glob("rollout_worker-*.jsonl"))) == 2
    for name in ("trainer", "worker-0", "worker-1", "scorer-0"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0

    # nothing lost on the bus: no DLQ entries, and what is left over is still queued, not dropped
    bus = await connect(BusConfig(servers=[fresh_server.url], name="check"))
    try:
        dlq = await bus.js.stream_info(topo.DLQ)
        assert dlq.state.messages == 0
        for stream, durable in (
            (topo.TASKS, topo.ROLLOUT_CONSUMER),
            (topo.ROLLOUTS, topo.SCORER_CONSUMER),
            (topo.SCORED, topo.TRAINER_CONSUMER),
        ):
            info = await bus.js.consumer_info(stream, durable)
            st = await bus.js.stream_info(stream)
            # work-queue streams: every message left is one the consumer has not acked yet
            assert st.state.messages == info.num_pending + info.num_ack_pending, (stream, st.state, info)
            assert info.delivered.stream_seq > 0, f"nothing flowed through {stream}"
        # signed by default: no key in the config, every version signed with the run's own pair,
        # and no worker followed weights unchecked
        pk = signing.public_key((run_dir / "keys" / "run-signing.pub").read_text().strip())
        w = (await bus.js.stream_info(topo.WEIGHTS)).state
        assert w.messages >= 6
        for seq in range(w.first_seq, w.last_seq + 1):
            ev = decode((await bus.js.get_msg(topo.WEIGHTS, seq=seq)).data)
            data = ev.payload if ev.payload is not None else await bus.get_blob(ev.blob)
            signing.verify(pk, data, ev.signature)
        for n in ("worker-0", "worker-1"):
            assert "WITHOUT signature" not in (run_dir / "logs" / f"{n}.log").read_text(), n
    finally:
        await bus.close()


def test_up_checkpointing_every_k_versions_keeps_feeding(fresh_server, tmp_path):
    """[trainer.checkpoint] every = 8: the batches of versions published uncheckpointed stay unacked
    in SCORED until the 8th. The feeder counted them as work ready to train and stopped feeding at
    3 × groups; once the queued work was trained the run waited for a batch that never came
    (deploy/demo.toml with every = 4: "time limit at version 3"). It must run on to its steps and
    checkpoint the 8th version."""
    cfg = tmp_path / "up.toml"
    cfg.write_text(CONFIG.replace("backlog = 6", "backlog = 2") + "\n[trainer.checkpoint]\nevery = 8\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", "--config", str(cfg), "--steps", "10", "--minutes", "3"]
        + ["--nats", fresh_server.url, "--run-dir", str(run_dir), "--quiet"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stopped"].startswith("reached") and summary["versions"] >= 10, summary
    steps = [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "samples" in r]
    done = [r["version"] for r in steps if r["checkpointed"]]
    assert done[0] == 8 and all(v % 8 == 0 for v in done[:-1]), done  # the last: a clean end
    assert max(r["unacked_versions"] for r in steps) == 7
