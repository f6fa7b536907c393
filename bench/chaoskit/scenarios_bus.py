"""Scenarios that fault the broker or what travels on it: a nats-server killed and restarted on
its store, a node of a 3-node R3 cluster lost, malformed events and a poison task, and forged
weight events from a hostile publisher."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import msgpack
import msgspec

import delta_codec
from asyncrl.nats_server import EmbeddedServer
from bus import topology as topo
from bus.events import Rollout, Scored, Task
from bus.weights.rules import signed_fields
from delta_codec.signing import generate_keypair, sign

from .books import row
from .fleet import ChaosError, Fleet, pipeline, start_signed
from .nats_configs import (
    ConfServer,
    cluster_replacements,
    get_json,
    render_nats_configs,
    role_env_vars,
    role_passwords,
    wait_until,
)
from .observe import refusal_reasons, version_line, worker_beats
from .params import GROUP, MAX_TOKENS, RATE
from .streams import dlq_entries, weights_by_seq, weights_history


async def restart_nats(run_dir: Path, tasks: int = 100, seed: int = 4, down_s: float = 2.0) -> dict:
    """Kill the nats-server mid-run and start it again on the same store dir and port."""
    srv = EmbeddedServer(store_dir=run_dir / "nats")
    await srv.start()
    fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
    try:
        await pipeline(fleet, workers=2)
        ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
        await fleet.wait_version(2, 300, watch=fleet.alive())
        await asyncio.sleep(random.Random(seed).uniform(0.5, 3.0))
        before = await fleet.version()
        t_kill = time.monotonic()
        await srv.restart(kill=True, down_s=down_s)  # SIGKILL: no clean shutdown of the store
        t_up = time.monotonic()
        await fleet.wait_version(before + 1, 120, watch=fleet.alive())
        rec = time.monotonic() - t_kill  # includes the down_s outage
        books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
        return row(
            "nats_restart", books, rec, True, down_s=down_s, after_up_s=round(rec - (t_up - t_kill), 2)
        )
    finally:
        await fleet.close()
        await srv.stop()


async def cluster_node_loss(run_dir: Path, tasks: int = 100, seed: int = 5) -> dict:
    """3-node JetStream cluster (deploy/nats configs, per-role users), R3 streams; SIGKILL a
    random node mid-run (clients list all three); training continues, nothing lost."""
    passwords = role_passwords()
    conf = render_nats_configs(run_dir / "conf", cluster_replacements(run_dir))
    nodes = [
        ConfServer(conf / f"cluster-{n}.conf", role_env_vars(passwords), run_dir / f"nats-{n}.log")
        for n in "abc"
    ]
    fleet = None
    try:
        await asyncio.gather(*(asyncio.to_thread(n.start) for n in nodes))

        def meta_leader():
            leaders = {
                (get_json(f"{n.monitor_url}/jsz").get("meta_cluster") or {}).get("leader") for n in nodes
            }
            return len(leaders) == 1 and None not in leaders

        await asyncio.to_thread(wait_until, meta_leader, 60, "JetStream meta leader")
        roles = {r: (r, passwords[r]) for r in ("admin", "trainer", "worker", "scorer")}
        fleet = await Fleet(run_dir, [n.url for n in nodes], replicas=3, roles=roles, seed=seed).open()
        await pipeline(fleet, workers=2)
        ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
        await fleet.wait_version(2, 300, watch=fleet.alive())
        await asyncio.sleep(random.Random(seed).uniform(0.5, 3.0))
        victim = random.Random(seed).choice(nodes)
        before = await fleet.version()
        victim.stop(kill=True)
        t_kill = time.monotonic()
        await fleet.wait_version(before + 1, 120, watch=fleet.alive())
        rec = time.monotonic() - t_kill
        books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
        return row("cluster_node_sigkill", books, rec, True, node=victim.conf.stem, replicas=3)
    finally:
        if fleet is not None:
            await fleet.close()
        await asyncio.gather(*(asyncio.to_thread(n.stop) for n in nodes))


def bad_bodies(good) -> dict[str, bytes]:
    """Malformed msgpack, wrong schema, a missing required field, an absurd size claim: bodies
    that decode (or the consumer's own checks) must refuse, for the kind of event `good` is."""
    d = good.to_dict()
    required = next(
        f.name
        for f in msgspec.structs.fields(good)
        if f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT
    )
    huge = list(range(100)) * 2000  # 200,000 prompt tokens > events.MAX_TOKENS
    if "rollout" in d:  # Scored: the rollout inside claims it
        absurd = {**d, "rollout": {**d["rollout"], "prompt_ids": huge}}
    elif "prompt_ids" in d:
        absurd = {**d, "prompt_ids": huge}
    else:  # Task: a 10^9-token, 10^9-sample request
        absurd = {**d, "task_id": "absurd", "sampling": {"max_tokens": 10**9, "n": 10**9}}
    return {
        "malformed": b"\xc1\x00not msgpack",
        "wrong_schema": msgpack.packb({**d, "schema": 99}),
        "missing_field": msgpack.packb({k: v for k, v in d.items() if k != required}),
        "absurd_size": msgpack.packb(absurd),
    }


async def bad_input(run_dir: Path, tasks: int = 40, seed: int = 7) -> dict:
    """Bad events on every work stream and a poison task (its verifier raises on every delivery)
    while real processes train: each bad body lands in DLQ with a reason, the poison task after
    max_deliver deliveries; every good task is still trained once."""
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            await pipeline(fleet, workers=1)
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            ro = Rollout(
                rollout_id="bad-0",
                task_id="bad",
                env="arith",
                sample_index=0,
                group_size=GROUP,
                prompt="1+1=",
                spec={"answer": "2"},
                prompt_ids=[1, 2],
                completion_ids=[3],
                completion_text="#2",
                logprobs=[-0.1],
                token_versions=[0],
                sampling={},
                sampling_mask={},
                quant={},
                finish_reason="stop",
                cost_tokens=1,
                wall_s=0.0,
                worker_id="x",
            )
            t = Task(task_id="bad-task", env="arith", prompt="1+1=", spec={"answer": "2"})
            sc = Scored(
                rollout=ro.to_dict(),
                success=1.0,
                cost=1.0,
                lambda_=0.0,
                penalty=0.0,
                reward=1.0,
                reason="ok",
                cost_wall_s=0.0,
                tool_calls=0,
                scorer_id="x",
            )
            sent = 0
            for subject, good in (
                (topo.task_subject("arith"), t),
                (topo.rollout_subject("arith"), ro),
                (topo.scored_subject("arith"), sc),
            ):
                for kind, body in bad_bodies(good).items():
                    await fleet.bus.publish(subject, body, msg_id=f"bad-{subject}-{kind}")
                    sent += 1
            # poison: int() of a 5000-digit answer raises ValueError inside the verifier, every time
            poison = Task(
                task_id="poison",
                env="arith",
                prompt="1+1=",
                spec={"answer": "9" * 5000},
                sampling={"n": GROUP, "max_tokens": MAX_TOKENS},
            )
            await fleet.bus.publish(topo.task_subject("arith"), poison)
            t0 = time.monotonic()
            books = await fleet.wait_trained(ids, 600, feeding=feeding, watch=fleet.alive())
            want = sent + GROUP  # the poison task's rollouts are parked one by one
            while len(entries := await dlq_entries(fleet.bus)) < want and time.monotonic() - t0 < 120:
                await asyncio.sleep(0.5)
            reasons = [r for _, r in entries]
            poison_parked = sum(1 for r in reasons if "handler failed" in r and "ValueError" in r)
            return row(
                "bad_input_dlq",
                books,
                time.monotonic() - t0,
                len(entries) == want and all(reasons) and poison_parked == GROUP,
                bad_events=sent,
                dlq=len(entries),
                poison_parked=poison_parked,
                reasons=sorted({r[:90] for r in reasons}),
            )
        finally:
            await fleet.close()


HUGE_EPOCH = 10**9


async def forged_weights(run_dir: Path, tasks: int = 60, seed: int = 9) -> dict:
    """A signed run; a hostile publisher on rl.weights.> replays the first keyframe with a huge
    epoch, re-labels it as a future version, and swaps a validly signed payload of another epoch
    into a delta announcement. Every worker refuses each one and keeps following the real leader
    (its versions keep rising on the real epoch); every task is trained exactly once."""
    sk, pk = generate_keypair()
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            await start_signed(fleet, sk, pk)
            ids, feeding = fleet.feed(tasks, over_s=tasks / RATE)
            await fleet.wait_version(2, 300, watch=fleet.alive())
            history = await weights_history(fleet.bus)
            kf0 = next(e for e in history if e.KIND == "Keyframe")
            last = [e for e in history if e.KIND == "Delta"][-1]
            epoch = kf0.epoch
            # a payload validly signed by the trainer's key, but for another (deposed) epoch
            base = {
                k: v.clone()
                for k, v in delta_codec.load_keyframe(
                    delta_codec.Keyframe.from_bytes(
                        kf0.payload if kf0.payload is not None else await fleet.bus.get_blob(kf0.blob)
                    )
                ).items()
            }
            other = {k: (v + 1).to(v.dtype) if v.is_floating_point() else v for k, v in base.items()}
            d = delta_codec.encode_delta(
                base, other, from_version=last.to_version, to_version=last.to_version + 1
            )
            payload = delta_codec.Delta(
                d.from_version, d.to_version, d.records, extra=signed_fields(epoch - 1, kf0.trainer_id)
            ).to_bytes()
            await fleet.bus.put_blob("forged-swap", payload)
            forgeries = [
                (topo.KEYFRAME_SUBJECT, msgspec.structs.replace(kf0, epoch=HUGE_EPOCH), "forged-epoch"),
                (
                    topo.KEYFRAME_SUBJECT,
                    msgspec.structs.replace(kf0, version=last.to_version + 50),
                    "forged-version",
                ),
                (
                    topo.DELTA_SUBJECT,
                    msgspec.structs.replace(
                        last,
                        from_version=d.from_version,
                        to_version=d.to_version,
                        size=len(payload),
                        base_digest=d.base_digest,
                        new_digest=d.new_digest,
                        signature=sign(sk, payload),
                        payload=None,
                        blob="forged-swap",
                        epoch=epoch,
                    ),
                    "forged-swap",
                ),
            ]
            t0 = time.monotonic()
            forged_seqs = {
                (await fleet.bus.publish(subject, ev, msg_id=mid)).seq for subject, ev, mid in forgeries
            }
            v_forged = await fleet.version()
            await fleet.wait_version(v_forged + 2, 300, watch=fleet.alive())
            # every worker back on the real line: newest versions, the real epoch
            while True:
                beats = await worker_beats(fleet)
                if len(beats) == 2 and all(
                    b["version"] >= v_forged + 1 and b.get("epoch") == epoch for b in beats.values()
                ):
                    break
                if time.monotonic() - t0 > 120:
                    raise ChaosError(f"workers not back on the real leader: {beats}")
                await asyncio.sleep(0.5)
            recovery = time.monotonic() - t0
            books = await fleet.wait_trained(ids, 600, feeding=feeding, with_checkpoint=True, watch=["A"])
            refusals = {
                n: dict(refusal_reasons(p.log_path))
                for n, p in fleet.procs.items()
                if p.component == "rollout_worker"
            }
            # each worker examined the forged keyframe (newer epoch) and the forged future version
            each = all(
                r.get("fields", 0) + r.get("epoch", 0) >= 1 and r.get("corrupt", 0) >= 1
                for r in refusals.values()
            )
            line = version_line([e for seq, e in await weights_by_seq(fleet.bus) if seq not in forged_seqs])
            return row(
                "forged_weights",
                books,
                recovery,
                each and not line["forks"] and not line["gaps"],
                forgeries=len(forgeries),
                versions=line["top"],
                refusals=refusals,
                worker_epochs=sorted({b.get("epoch") for b in beats.values()}),
                real_epoch=epoch,
            )
        finally:
            await fleet.close()
