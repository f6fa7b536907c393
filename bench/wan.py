"""Weights to inference regions over an emulated WAN: `python -m bench.wan --json`.

A hub and N regions on one machine (bench.wanlab): each region a nats-server with its own
JetStream domain behind a bench.delayline link (one-way delay, rate, loss), K workers per region
in one process per region (bench.wan_region), each running the real WeightFollower + apply on a
bf16 state. A publisher on the hub sends versions of a transformer-shaped bf16 model (~`--changed`
of the elements moved per version) at a fixed interval. The 2 x 2:

    weights  full : a keyframe (full bf16) every version
             delta: a sparse codec delta every version, a keyframe every --keyframe-every
    read     hub   : every worker reads WEIGHTS and blobs from the hub, across the WAN
             mirror: workers read their region's mirrors (bus.weights.regions); one copy crosses

Per configuration and region: publish-ack -> patched p50/p95 (wall clock, one machine), WAN bytes
per version (hub -> region, counted at the link), version lag seen by the workers over time; and
hub egress per version (all links). Then the failure rows, with mirrors and deltas: a region's link
cut for --cut-s while versions go on (catch-up time after the link returns), and a region's server
killed while its workers hold tasks (tasks rerouted to other regions after ack_wait, lost).

Defaults are the full run (3 regions 20/80/150 ms at 50/20/10 Mbit, 3 workers each, 8.4 M params);
--quick runs tiny sizes in about a minute. --link tbf: each link's rate is capped by the kernel's
tbf on a veth between two network namespaces (bench.wantbf; root), the delay line keeping the
latency; where that is not available the delay line's token bucket, and the JSON says which
("link", "link_requested"). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

import delta_codec
from bus import topology as topo
from bus.events import Task
from bus.weights.publisher import WeightPublisher
from kernel import setup_logging

from .delayline import LinkSpec
from .stats import pct
from .wan_region import RegionProc
from .wanlab import Lab

NEAREST = "inverted_cdf"  # percentiles by nearest rank: a patch latency that was measured


# -- the model and its updates ------------------------------------------------------------------
def model_state(params: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 tensors shaped like a small transformer's, `params` elements in all."""
    g = torch.Generator().manual_seed(seed)
    d = 512
    n_mat = max(1, params // (d * d))
    out = {f"h{i}.w": (torch.randn(d, d, generator=g) * 0.02).to(torch.bfloat16) for i in range(n_mat)}
    rest = params - n_mat * d * d
    if rest > 0:
        out["norms"] = (1 + torch.randn(rest, generator=g) * 0.02).to(torch.bfloat16)
    return out


def step(state: dict, frac: float, seed: int) -> dict:
    """~frac of the elements moved by a few bf16 ulps (what an optimizer step does)."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, t in state.items():
        f = t.float()
        mask = torch.rand(f.shape, generator=g) < frac
        new[k] = torch.where(mask, f * (1 + 0.01 * torch.randn(f.shape, generator=g)), f).to(torch.bfloat16)
    return new


# -- one configuration ----------------------------------------------------------------------------
@dataclass
class Cfg:
    weights: str  # full | delta
    read: str  # hub | mirror


async def wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def new_lab(a, root: str, **kw) -> Lab:
    lab = Lab(
        root,
        a.regions,
        topology=topo.TopologyConfig(
            storage="memory", ack_wait_s=a.ack_wait_s, max_deliver=50, weights_keep=a.weights_keep
        ),
        link=a.link,
        **kw,
    )
    return await lab.start()


async def run_config(a, c: Cfg, base_state: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-wan-") as root:
        lab = await new_lab(a, root, mirrors=c.read == "mirror")  # no mirror traffic in hub runs
        procs = {r: RegionProc(lab, r, a.workers, c.read) for r in a.regions}
        try:
            hub = await lab.hub_bus("bench-trainer")
            pub = WeightPublisher(hub, epoch=1, trainer_id="bench")
            state = base_state
            await pub.publish_keyframe(state, 0, {})
            await asyncio.gather(*(p.start() for p in procs.values()))
            if not await wait_for(lambda: all(p.min_version() >= 0 for p in procs.values()), a.drain_s):
                raise RuntimeError(f"{c}: workers did not load keyframe v0 in {a.drain_s}s")
            before = await lab.counters()
            acked, sizes, lag, dsizes, ksizes = {}, [], [], [], []
            t_start = time.monotonic()
            for v in range(1, a.versions + 1):
                new = step(state, a.changed, v)
                if c.weights == "full":
                    ev = await pub.publish_keyframe(new, v, {})
                    sizes.append(ev.size)
                    ksizes.append(ev.size)
                else:
                    d = await asyncio.to_thread(
                        delta_codec.encode_delta, state, new, from_version=v - 1, to_version=v
                    )
                    ev = await pub.publish_delta(d)
                    sizes.append(ev.size)
                    dsizes.append(ev.size)
                    if v % a.keyframe_every == 0:
                        kf = await pub.publish_keyframe(new, v, {}, set_version=False)
                        sizes[-1] += kf.size
                        ksizes.append(kf.size)
                acked[v] = time.time()
                state = new
                # sample the lag until the next publish is due
                due = t_start + v * a.interval_s
                while time.monotonic() < due:
                    lag.append(
                        {
                            "t": round(time.monotonic() - t_start, 2),
                            **{r: v - p.min_version() for r, p in procs.items()},
                        }
                    )
                    await asyncio.sleep(min(0.25, max(0.0, due - time.monotonic())))
            ok = await wait_for(lambda: all(p.min_version() >= a.versions for p in procs.values()), a.drain_s)
            await asyncio.sleep(0.5)
            after = await lab.counters()
            per_region = {}
            for r, p in procs.items():
                lat = [p.patched[(w, v)] - acked[v] for (w, v) in p.patched if v in acked]
                wan = after[r]["down"]["bytes"] - before[r]["down"]["bytes"]
                per_region[r] = {
                    "patch_p50_s": pct(lat, 50, NEAREST),
                    "patch_p95_s": pct(lat, 95, NEAREST),
                    "wan_bytes_per_version": wan / a.versions,
                    "wan_per_payload": round(wan / max(1, sum(sizes)), 3),
                    "max_lag": max((s[r] for s in lag), default=0),
                    "caught_up": p.min_version() >= a.versions,
                    "link": a.regions[r].__dict__,
                }
            egress = sum(after[r]["down"]["bytes"] - before[r]["down"]["bytes"] for r in procs) / a.versions
            return {
                "weights": c.weights,
                "read": c.read,
                "payload_bytes_per_version": statistics.mean(sizes),
                "delta_bytes_mean": statistics.mean(dsizes) if dsizes else None,
                "keyframe_bytes_mean": statistics.mean(ksizes) if ksizes else None,
                "hub_egress_per_version": egress,
                "regions": per_region,
                "all_caught_up": ok,
                "lag_over_time": lag[:: max(1, len(lag) // 60)],
            }
        finally:
            for p in procs.values():
                await p.stop()
            await lab.close()


async def run_failures(a, base_state: dict) -> dict:
    """Mirrors + deltas. (1) the last region's link is cut for cut_s while versions go on;
    catch-up = from link back to all its workers on the newest version. (2) tasks: the last
    region's server is killed while its workers hold tasks."""
    victim = list(a.regions)[-1]
    with tempfile.TemporaryDirectory(prefix="bench-wan-f-") as root:
        lab = await new_lab(a, root)
        procs = {r: RegionProc(lab, r, a.workers, "mirror", task_hold_s=a.task_hold_s) for r in a.regions}
        try:
            hub = await lab.hub_bus("bench-trainer")
            pub = WeightPublisher(hub, epoch=1, trainer_id="bench")
            state = base_state
            await pub.publish_keyframe(state, 0, {})
            await asyncio.gather(*(p.start() for p in procs.values()))
            await wait_for(lambda: all(p.min_version() >= 0 for p in procs.values()), a.drain_s)
            v = 0

            async def publish_for(seconds: float):
                nonlocal v, state
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    v += 1
                    new = step(state, a.changed, v)
                    d = await asyncio.to_thread(
                        delta_codec.encode_delta, state, new, from_version=v - 1, to_version=v
                    )
                    await pub.publish_delta(d)
                    if v % a.keyframe_every == 0:
                        await pub.publish_keyframe(new, v, {}, set_version=False)
                    state = new
                    await asyncio.sleep(a.interval_s)

            await publish_for(2 * a.interval_s)
            await lab.cut(victim)
            await publish_for(a.cut_s)
            behind = v - procs[victim].min_version()
            await lab.restore(victim)
            t_back = time.monotonic()
            caught = await wait_for(lambda: procs[victim].min_version() >= v, a.catchup_timeout_s)
            catch_up_s = time.monotonic() - t_back if caught else None

            # tasks: every region works; the victim dies holding some
            await hub.publish_many(
                [
                    (topo.task_subject("wan"), Task(task_id=f"t{i}", env="wan", prompt="p"))
                    for i in range(a.tasks)
                ]
            )
            await wait_for(lambda: len(procs[victim].tasks) >= 1, 30)
            await lab.kill_region(victim)
            t_kill = time.monotonic()

            async def results() -> int:  # one ROLLOUTS message per task that has a result
                return (await hub.js.stream_info(topo.ROLLOUTS)).state.messages

            deadline = time.monotonic() + a.ack_wait_s * 4 + a.tasks * a.task_hold_s + 30
            while await results() < a.tasks and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            all_done = await results() >= a.tasks
            rerouted = sum(1 for r, p in procs.items() if r != victim for t in p.tasks if t["deliveries"] > 1)
            info = await hub.js.consumer_info(topo.TASKS, topo.ROLLOUT_CONSUMER)
            n_results = await results()
            return {
                "victim": victim,
                "link_cut_s": a.cut_s,
                "versions_behind_at_restore": behind,
                "catch_up_s": catch_up_s,
                "tasks": a.tasks,
                "tasks_done": n_results,
                "tasks_lost": a.tasks - n_results,
                "tasks_rerouted": rerouted,
                "all_done_s_after_kill": round(time.monotonic() - t_kill, 2) if all_done else None,
                "ack_wait_s": a.ack_wait_s,
                "pending_after": info.num_pending + info.num_ack_pending,
            }
        finally:
            for p in procs.values():
                await p.stop()
            await lab.close()


def parse_regions(spec: str, rate_scale: float, loss: float) -> dict[str, LinkSpec]:
    """ "name:delay_ms:rate_mbit,..." -> {name: LinkSpec}."""
    out = {}
    for part in spec.split(","):
        try:
            name, delay, rate = part.split(":")
            out[name] = LinkSpec(delay_ms=float(delay), rate_mbit=float(rate) * rate_scale, loss=loss)
        except ValueError as e:
            raise SystemExit(f"--regions: {part!r} is not name:delay_ms:rate_mbit ({e})") from e
    return out


async def main_async(a) -> dict:
    base = model_state(a.params, a.seed)
    n = sum(t.numel() for t in base.values())
    configs = [Cfg(w, r) for w in ("full", "delta") for r in ("hub", "mirror")]
    runs = []
    for c in configs:
        print(f"# {c.weights} / {c.read} ...", file=sys.stderr, flush=True)
        runs.append(await run_config(a, c, base))
    failure = await run_failures(a, base) if not a.no_failure else None
    return {
        "params": n,
        "full_bf16_bytes": 2 * n,
        "changed": a.changed,
        "versions": a.versions,
        "interval_s": a.interval_s,
        "keyframe_every": a.keyframe_every,
        "workers_per_region": a.workers,
        "regions": {r: s.__dict__ for r, s in a.regions.items()},
        "link": a.link,
        "link_requested": a.link_requested,
        "runs": runs,
        "failure": failure,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny sizes: 2 regions, 2 workers, 0.3 M params")
    p.add_argument("--params", type=int, default=8_400_000)
    p.add_argument("--changed", type=float, default=0.01)
    p.add_argument("--versions", type=int, default=20)
    p.add_argument("--interval-s", type=float, default=3.0)
    p.add_argument("--keyframe-every", type=int, default=10)
    p.add_argument("--weights-keep", type=int, default=64)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--regions", default="r20:20:50,r80:80:20,r150:150:10")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply every link's rate")
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument(
        "--link",
        choices=("proxy", "tbf"),
        default="proxy",
        help="rate cap: the delay line's token bucket, or the kernel's tbf on a veth between "
        "network namespaces (root; falls back to proxy where unavailable)",
    )
    p.add_argument("--cut-s", type=float, default=20.0)
    p.add_argument("--catchup-timeout-s", type=float, default=180.0)
    p.add_argument("--tasks", type=int, default=60)
    p.add_argument("--task-hold-s", type=float, default=0.5)
    p.add_argument("--ack-wait-s", type=float, default=5.0)
    p.add_argument("--drain-s", type=float, default=120.0)
    p.add_argument("--no-failure", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.quick:
        a.params, a.versions, a.interval_s, a.workers = 300_000, 4, 0.5, 2
        a.regions, a.cut_s, a.tasks, a.task_hold_s, a.ack_wait_s = "q20:20:50,q80:80:20", 2.0, 12, 0.2, 2.0
        a.keyframe_every, a.drain_s, a.catchup_timeout_s = 3, 60.0, 90.0
    a.regions = parse_regions(a.regions, a.rate_scale, a.loss)
    a.link_requested = a.link
    if a.link == "tbf":
        from .wantbf import tbf_available

        if not tbf_available():
            print(
                "# --link tbf: no tbf in network namespaces here (needs root, ip, tc); "
                "the delay line's token bucket caps the rate",
                file=sys.stderr,
                flush=True,
            )
            a.link = "proxy"
    setup_logging("bench-wan", level="warning")
    torch.set_num_threads(1)
    out = asyncio.run(main_async(a))
    if a.json:
        print(json.dumps(out))
    else:
        for r in out["runs"]:
            print(
                f"{r['weights']:5s} {r['read']:6s} egress/v={r['hub_egress_per_version']:.0f}B  "
                + "  ".join(
                    f"{n}: p50={x['patch_p50_s']} p95={x['patch_p95_s']} "
                    f"wan/v={x['wan_bytes_per_version']:.0f}"
                    for n, x in r["regions"].items()
                )
            )
        print(json.dumps(out["failure"]))


if __name__ == "__main__":
    main()
