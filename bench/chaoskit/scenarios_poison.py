"""Poisoned numbers: one bad number must not poison the fleet.

While a signed run trains, a hostile (or broken) sender publishes, on ROLLOUTS and SCORED, events
with NaN, ±inf, 1e300, strings, ints beyond int64, out-of-range values and out-of-vocabulary ids
in every float and int field of Rollout and Scored (lists included, at index 1), and a delta
signed with the run's own key whose result has NaN weights (so only the finiteness check can
stop it). What must hold:

    every bad event parked in DLQ on its first delivery, its Rl-Reason naming the field (and the
    index, in a list); a rollout with out-of-vocabulary ids passes the scorer (it does not know
    the vocabulary) and is parked by the trainer
    every worker refuses the NaN delta (reason `nonfinite`), keeps its weights and follows the
    real leader on; every version on WEIGHTS but the forged one decodes to finite weights
    training continues: every good task trained, none trained twice
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import msgpack

import delta_codec
from asyncrl.nats_server import EmbeddedServer
from bus import topology as topo
from bus.events import DeltaEvent, Rollout, Scored
from bus.weights.follower import WeightFollower
from bus.weights.rules import signed_fields
from delta_codec.errors import NonFiniteError
from delta_codec.signing import generate_keypair, sign

from .books import row
from .fleet import ChaosError, Fleet, start_signed
from .observe import refusal_reasons, worker_beats
from .params import GROUP, RATE
from .streams import stream_messages, weights_by_seq

HUGE_INT = 2**64 - 1  # msgpack carries it; it does not fit int64
FLOATS_FULL = (math.nan, math.inf, -math.inf, 1e300, -1e300, "1.5")
FLOATS_SHORT = (math.nan, math.inf, 1e300, "1.5")
INTS_FULL = (math.nan, math.inf, -math.inf, 1e300, "3", HUGE_INT)
INTS_SHORT = (math.nan, "3", HUGE_INT)
# per int field: a value of the right type outside its range
OUT_OF_RANGE = {
    "sample_index": -1,
    "group_size": -1,
    "cost_tokens": -1,
    "epoch": -1,
    "turns": 0,
    "tool_calls": -1,
    "prompt_ids": -1,
    "completion_ids": -1,
    "token_versions": -2,
    "loss_mask": 2,
}
ROLLOUT_FLOATS = ("wall_s",)
ROLLOUT_INTS = ("sample_index", "group_size", "cost_tokens", "epoch", "turns", "tool_calls")
ROLLOUT_LISTS = {
    "logprobs": float,
    "prompt_ids": int,
    "completion_ids": int,
    "token_versions": int,
    "loss_mask": int,
}
SCORED_FLOATS = ("success", "cost", "lambda_", "penalty", "reward", "cost_wall_s")
SCORED_INTS = ("tool_calls",)


def base_rollout(rid: str) -> dict:
    ro = Rollout(
        rollout_id=rid,
        task_id=rid.rsplit("-", 1)[0],
        env="arith",
        sample_index=0,
        group_size=GROUP,
        prompt="1+1=",
        spec={"answer": "2"},
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5, 6],
        completion_text="#2",
        logprobs=[-0.1, -0.2, -0.3],
        token_versions=[0, 0, 0],
        sampling={},
        sampling_mask={},
        quant={},
        finish_reason="stop",
        cost_tokens=3,
        wall_s=0.5,
        worker_id="poison",
    )
    return ro.to_dict()


def scored_of(rollout: dict, **over) -> dict:
    sc = Scored(
        rollout=rollout,
        success=1.0,
        cost=3.0,
        lambda_=0.0,
        penalty=0.0,
        reward=1.0,
        reason="ok",
        cost_wall_s=0.5,
        tool_calls=0,
        scorer_id="poison",
    )
    return {**sc.to_dict(), **over}


def rollout_poisons(vocab: int, short: bool) -> list[tuple[str, dict, str]]:
    """(field, the rollout dict with one bad value, what the reason must name) for every bad value
    of every float and int field of a Rollout."""
    floats, ints = (FLOATS_SHORT, INTS_SHORT) if short else (FLOATS_FULL, INTS_FULL)
    out = []
    for f in ROLLOUT_FLOATS:
        out += [(f, {f: v}, f) for v in floats]
    for f in ROLLOUT_INTS:
        out += [(f, {f: v}, f) for v in (*ints, OUT_OF_RANGE[f])]
    for f, kind in ROLLOUT_LISTS.items():
        values = floats if kind is float else (*ints, OUT_OF_RANGE[f])
        if f in ("prompt_ids", "completion_ids"):
            values = (*values, vocab + 3)  # out of the vocabulary: only the trainer knows it
        for v in values:
            good = [1, 1, 1] if f == "loss_mask" else base_rollout("p-0")[f]
            out.append((f, {f: [good[0], v, good[2]]}, f"{f}[1]"))
    out.append(("token_versions", {"token_versions": [1, 0, 1]}, "token_versions[1]"))  # goes back
    return out


def scored_poisons(short: bool) -> list[tuple[str, dict, str]]:
    floats, ints = (FLOATS_SHORT, INTS_SHORT) if short else (FLOATS_FULL, INTS_FULL)
    out = [(f, {f: v}, f) for f in SCORED_FLOATS for v in floats]
    out += [(f, {f: v}, f) for f in SCORED_INTS for v in (*ints, -1)]
    return out + [("success", {"success": 2.0}, "success")]


async def publish_poison(bus, vocab: int, short: bool) -> dict[str, str]:
    """Publish every poisoned event; -> rollout id -> the text its DLQ reason must contain."""
    want: dict[str, str] = {}
    items = []
    for i, (_f, bad, named) in enumerate(rollout_poisons(vocab, short)):
        for path in ("rollouts", "scored"):  # bare on ROLLOUTS, inside a Scored on SCORED
            rid = f"poison-{path}-{i}-0"  # (no field name in the id: the reason must name it)
            ro = {**base_rollout(rid), **bad}
            if path == "rollouts":
                items.append((topo.rollout_subject("arith"), ro, rid))
            else:
                items.append((topo.scored_subject("arith"), scored_of(ro), rid))
            want[rid] = named
    for i, (_f, bad, named) in enumerate(scored_poisons(short)):
        rid = f"poison-score-{i}-0"
        items.append((topo.scored_subject("arith"), scored_of(base_rollout(rid), **bad), rid))
        want[rid] = named
    for subject, body, rid in items:
        await bus.publish(subject, msgpack.packb(body), msg_id=f"poison-{rid}")
    return want


def poisoned_id(data: bytes) -> str:
    """The rollout id of a DLQ body (raw msgpack: these bodies do not decode, by design)."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:
        return ""
    if not isinstance(d, dict):
        return ""
    inner = d.get("rollout") if isinstance(d.get("rollout"), dict) else d
    rid = inner.get("rollout_id", "")
    return rid if isinstance(rid, str) else ""


async def parked_poison(bus) -> dict[str, tuple[str, str]]:
    """rollout id -> (Rl-Reason, Rl-Deliveries) of every poisoned event parked in DLQ."""
    out = {}
    for raw in await stream_messages(bus, topo.DLQ, "rl.dlq.>"):
        rid = poisoned_id(raw.data or b"")
        if rid.startswith("poison-"):
            h = raw.headers or {}
            out[rid] = (h.get("Rl-Reason", ""), h.get("Rl-Deliveries", ""))
    return out


def poison_state(state: dict) -> dict:
    """The state with NaN in a few elements of every floating tensor (what a diverged step makes)."""
    out = {}
    for k, v in state.items():
        v = v.clone()
        if v.is_floating_point() and v.numel():
            v.view(-1)[:: max(1, v.numel() // 3)] = float("nan")
        out[k] = v
    return out


async def publish_nan_delta(fleet: Fleet, sk, pk, attempts: int = 10) -> tuple[set[int], int]:
    """A delta from the head of WEIGHTS to NaN weights, signed with the run's key and carrying the
    leader's epoch and id. Published until it lands right after the head it was built on (else a
    real delta got in between and workers would skip it as a replay).
    -> (the sequences of every attempt, the version of the one that landed)."""
    seqs: set[int] = set()
    for _ in range(attempts):
        feed = WeightFollower(fleet.bus, public_key=pk, name="poisoner")
        target = await feed.latest_state()
        await feed.close()
        head_seq = feed.cursor
        _, last = (await weights_by_seq(fleet.bus))[-1]
        d = delta_codec.encode_delta(
            target.state,
            poison_state(target.state),
            from_version=target.version,
            to_version=target.version + 1,
        )
        payload = delta_codec.Delta(
            d.from_version,
            d.to_version,
            d.records,
            extra=signed_fields(target.epoch, last.trainer_id),
            base_digest=d.base_digest,
            new_digest=d.new_digest,
        ).to_bytes()
        ev = DeltaEvent(
            from_version=d.from_version,
            to_version=d.to_version,
            epoch=target.epoch,
            codec=delta_codec.CODEC,
            size=len(payload),
            base_digest=d.base_digest,
            new_digest=d.new_digest,
            signature=sign(sk, payload),
            payload=None,
            blob=f"poison-nan-{head_seq}",
            trainer_id=last.trainer_id,
        )
        await fleet.bus.put_blob(ev.blob, payload)
        ack = await fleet.bus.publish(topo.DELTA_SUBJECT, ev, msg_id=f"poison-nan-{head_seq}")
        seqs.add(int(ack.seq))
        if ack.seq == head_seq + 1:
            return seqs, d.to_version
        await asyncio.sleep(0.2)
    raise ChaosError(f"the NaN delta never landed right after the head in {attempts} attempts")


async def published_nonfinite(bus, skip: set[int]) -> tuple[int, int]:
    """Walk every WEIGHTS version but the `skip` sequences with the finiteness check on:
    -> (versions checked, versions with a NaN/±inf weight)."""
    state, version, checked, bad = None, -1, 0, 0
    for seq, ev in await weights_by_seq(bus):
        if seq in skip:
            continue
        data = ev.payload if ev.payload is not None else await bus.get_blob(ev.blob)
        try:
            if ev.KIND == "Keyframe":
                state = delta_codec.load_keyframe(delta_codec.Keyframe.from_bytes(data), finite=True)
                version = ev.version
            elif ev.KIND == "Delta" and state is not None and ev.from_version == version:
                delta_codec.apply_delta(state, delta_codec.Delta.from_bytes(data), finite=True)
                version = ev.to_version
            else:
                continue
        except NonFiniteError:
            bad += 1
        checked += 1
    return checked, bad


async def poison_numbers(run_dir: Path, tasks: int = 60, seed: int = 13, short: bool = False) -> dict:
    """Bad numbers in every field of every work event plus a signed NaN delta, mid-run (module doc)."""
    sk, pk = generate_keypair()
    async with EmbeddedServer(store_dir=run_dir / "nats") as srv:
        fleet = await Fleet(run_dir, [srv.url], seed=seed).open()
        try:
            await start_signed(fleet, sk, pk)
            first = tasks // 2  # half before the poison, half after: training goes on
            ids, feeding = fleet.feed(first, over_s=first / RATE)
            await fleet.wait_version(1, 300, watch=fleet.alive())
            history = [e for _, e in await weights_by_seq(fleet.bus)]
            vocab = int(next(e for e in history if e.KIND == "Keyframe").model_config["vocab_size"])
            t0 = time.monotonic()
            want = await publish_poison(fleet.bus, vocab, short)
            nan_seqs, nan_version = await publish_nan_delta(fleet, sk, pk)
            await feeding
            more, feeding = fleet.feed(tasks - first, over_s=(tasks - first) / RATE)
            workers = fleet.alive("rollout_worker")
            while not all(refusal_reasons(fleet.procs[n].log_path)["nonfinite"] >= 1 for n in workers):
                if time.monotonic() - t0 > 120:
                    seen = {n: dict(refusal_reasons(fleet.procs[n].log_path)) for n in workers}
                    raise ChaosError(f"workers did not refuse the NaN delta: {seen}")
                fleet.check_alive(fleet.alive())
                await asyncio.sleep(0.5)
            # training goes on past the forged version, and every worker follows it
            await fleet.wait_version(nan_version + 1, 300, watch=fleet.alive())
            while True:
                beats = await worker_beats(fleet)
                if len(beats) == len(workers) and all(b["version"] >= nan_version for b in beats.values()):
                    break
                if time.monotonic() - t0 > 240:
                    raise ChaosError(f"workers not back on the real leader: {beats}")
                await asyncio.sleep(0.5)
            recovery = time.monotonic() - t0
            await feeding
            books = await fleet.wait_trained(ids + more, 600, with_checkpoint=True, watch=fleet.alive())
            while len(parked := await parked_poison(fleet.bus)) < len(want) and time.monotonic() - t0 < 300:
                await asyncio.sleep(0.5)
            missing = sorted(set(want) - set(parked))
            unnamed = {r: parked[r][0][:200] for r in want if r in parked and want[r] not in parked[r][0]}
            retried = {r: parked[r][1] for r in want if r in parked and parked[r][1] != "1"}
            checked, nonfinite = await published_nonfinite(fleet.bus, nan_seqs)
            logs = "".join(fleet.procs[n].log_path.read_text(errors="replace") for n in workers)
            sampled_nan = logs.count("non-finite logits")
            refusals = {n: dict(refusal_reasons(fleet.procs[n].log_path)) for n in workers}
            ok = (
                not missing
                and not unnamed
                and not retried
                and nonfinite == 0
                and checked >= 2
                and sampled_nan == 0
            )
            return row(
                "poison_numbers",
                books,
                recovery,
                ok,
                bad_events=len(want),
                parked=len(parked),
                missing=missing[:10],
                unnamed=dict(list(unnamed.items())[:5]),
                retried=retried,
                versions_checked=checked,
                nonfinite_published=nonfinite,
                nan_delta_version=nan_version,
                worker_refusals=refusals,
                nonfinite_sampled=sampled_nan,
                nan_delta_attempts=len(nan_seqs),
                short=short,
            )
        finally:
            await fleet.close()
