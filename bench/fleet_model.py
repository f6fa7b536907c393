"""What weight distribution costs a 1 T-parameter fleet in 1-20 regions: `python -m bench.fleet_model`.

A small discrete-event model (fluid flows, max-min fair share of the hub's egress): every step
the trainer publishes a version; each region receives it over its own WAN link and is patched
when its last byte arrives plus a fixed protocol cost in round trips. Three strategies:

    full   full bf16 weights every version, one copy per region (a relay in each region)
    delta  sparse delta every version (keyframe every --keyframe-every), pulled across the WAN by
           each of the region's --nodes inference nodes (no regional mirror: K copies)
    relay  sparse delta, one copy per region into its mirror (bus.weights.regions); nodes read locally

Printed per strategy and region count: time to patch (p50 / max over regions), hub egress per
step, share of rollouts generated with a policy more than --max-lag versions old (the lag a
region's workers see, sampled over --steps steps).

Inputs, and where each comes from:
  published  params 1e12; changed fraction 1-2 % of bf16 weights per step (default 1.5 %); inter-
             region RTT 40-150 ms; WAN 1-40 Gbit/s per region; keyframe every ~25 versions; a step
             every few minutes (default 180 s); hub egress --hub-gbit (an assumption, default 100)
  measured   bits per changed element 9.68 (bench.delta, ~1.1 % changed, docs/benchmarks.md);
             protocol overheads from a bench.wan JSON (--from-bench): WAN bytes / payload bytes
             (mirror, delta) and fixed round trips per version ((p50 - delay - bytes/rate) / RTT);
             without it the defaults below (marked "default", not measured) are used.
  model      TCP throughput per link min(rate, window / RTT) x efficiency, --window-mb 64.
Last line with --json: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass


@dataclass
class Inputs:
    params: float = 1e12
    changed: float = 0.015
    bits_per_changed: float = 9.68  # measured: bench.delta
    keyframe_every: int = 25
    step_s: float = 180.0
    rtt_ms: tuple = (40.0, 150.0)
    wan_gbit: tuple = (1.0, 40.0)
    hub_gbit: float = 100.0
    nodes: int = 8  # inference nodes per region (readers)
    window_mb: float = 64.0
    overhead: float = 1.05  # WAN bytes / payload bytes  (default; --from-bench: measured)
    fixed_rtts: float = 3.0  # round trips per version beyond the transfer (default)
    max_lag: int = 1
    steps: int = 100
    source: str = "default"

    @property
    def full_bytes(self) -> float:
        return 2 * self.params

    @property
    def delta_bytes(self) -> float:
        return self.params * self.changed * self.bits_per_changed / 8


def region_links(n: int, inp: Inputs) -> list[tuple[float, float]]:
    """(rtt_s, rate_bytes_s) for n regions, spread evenly: near regions fast, far ones slow."""
    out = []
    for i in range(n):
        x = i / max(1, n - 1)
        rtt = (inp.rtt_ms[0] + x * (inp.rtt_ms[1] - inp.rtt_ms[0])) / 1000
        gbit = inp.wan_gbit[1] - x * (inp.wan_gbit[1] - inp.wan_gbit[0])
        out.append((rtt, gbit * 1e9 / 8))
    return out


def link_rate(rtt: float, rate: float, inp: Inputs) -> float:
    return min(rate, inp.window_mb * 2**20 / rtt) / inp.overhead


def transfer(sizes: list[float], caps: list[float], hub: float) -> list[float]:
    """Fluid flows starting together, flow i capped at caps[i], sum of rates <= hub (max-min
    fair). -> finish time of each flow."""
    left = list(sizes)
    done = [0.0] * len(sizes)
    t = 0.0
    active = [i for i, s in enumerate(left) if s > 0]
    while active:
        # max-min fair allocation (water filling)
        rates, budget, pending = {}, hub, sorted(active, key=lambda i: caps[i])
        while pending:
            share = budget / len(pending)
            i = pending[0]
            if caps[i] <= share:
                rates[i] = caps[i]
                budget -= caps[i]
                pending.pop(0)
            else:
                for j in pending:
                    rates[j] = share
                pending = []
        dt = min(left[i] / rates[i] for i in active)
        t += dt
        for i in active:
            left[i] -= rates[i] * dt
        for i in [i for i in active if left[i] <= 1e-6 * max(1.0, sizes[i])]:
            done[i] = t
        active = [i for i in active if left[i] > 1e-6 * max(1.0, sizes[i])]
    return done


def simulate(strategy: str, n_regions: int, inp: Inputs) -> dict:
    links = region_links(n_regions, inp)
    hub = inp.hub_gbit * 1e9 / 8
    version_ready = [[0.0] * n_regions]  # time each region holds version v (v=0 at t=0)
    region_free = [0.0] * n_regions  # a region patches versions in order
    egress, patch = [], []
    for v in range(1, inp.steps + 1):
        t_pub = v * inp.step_s
        kf = v % inp.keyframe_every == 0
        if strategy == "full":
            per_region = inp.full_bytes
        else:
            per_region = inp.delta_bytes + (inp.full_bytes if kf else 0)  # the mirror copies keyframes too
        copies = inp.nodes if strategy == "delta" else 1
        if strategy == "delta" and kf:
            per_region = inp.delta_bytes  # followers skip a keyframe they do not need
        sizes, caps = [], []
        for rtt, rate in links:
            sizes.append(per_region * copies)
            caps.append(link_rate(rtt, rate, inp) * (copies if strategy == "delta" else 1))
        # a region still busy with an earlier version starts this one later
        starts = [max(t_pub, region_free[i]) for i in range(n_regions)]
        # simplification: this version's flows share the hub as if they started together
        fin = transfer(sizes, [min(c, hub) for c in caps], hub)
        ready = []
        for i, (rtt, _) in enumerate(links):
            t_done = starts[i] + fin[i] + inp.fixed_rtts * rtt
            region_free[i] = t_done
            ready.append(t_done)
            patch.append(t_done - t_pub)
        version_ready.append(ready)
        egress.append(sum(s * inp.overhead for s in sizes))
    # share of rollout time spent more than max_lag versions behind, sampled each second
    beyond = total = 0
    horizon = (inp.steps + 1) * inp.step_s
    for i in range(n_regions):
        held = 0
        for s in range(int(inp.step_s), int(horizon), max(1, int(inp.step_s // 30))):
            trainer_v = min(inp.steps, int(s // inp.step_s))
            while held + 1 < len(version_ready) and version_ready[held + 1][i] <= s:
                held += 1
            total += 1
            beyond += (trainer_v - held) > inp.max_lag
    per_region_p50 = statistics.median(patch)
    return {
        "strategy": strategy,
        "regions": n_regions,
        "patch_p50_s": per_region_p50,
        "patch_max_s": max(patch),
        "hub_egress_per_step_gb": statistics.mean(egress) / 1e9,
        "beyond_max_lag": beyond / total if total else 0.0,
    }


def from_bench(path: str, inp: Inputs) -> Inputs:
    """Overheads measured by bench.wan (mirror + delta run)."""
    with open(path) as f:
        d = json.loads(f.read().strip().splitlines()[-1])
    run = next(r for r in d["runs"] if r["weights"] == "delta" and r["read"] == "mirror")
    ratios, rtts = [], []
    for _name, r in run["regions"].items():
        link = r["link"]
        ratios.append(r["wan_per_payload"])
        one_way = link["delay_ms"] / 1000
        size = run["delta_bytes_mean"] or run["payload_bytes_per_version"]
        tx = size * 8 / (link["rate_mbit"] * 1e6) if link["rate_mbit"] else 0
        if r["patch_p50_s"] is not None and one_way > 0:
            rtts.append(max(0.0, (r["patch_p50_s"] - one_way - tx) / (2 * one_way)))
    inp.overhead = max(1.0, statistics.median(ratios))
    inp.fixed_rtts = statistics.median(rtts) if rtts else inp.fixed_rtts
    inp.source = f"measured ({path})"
    return inp


def table(inp: Inputs, counts: list[int]) -> list[dict]:
    return [simulate(s, n, inp) for s in ("full", "delta", "relay") for n in counts]


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for s, style in (("full", "o-"), ("delta", "s-"), ("relay", "^-")):
        rs = [r for r in rows if r["strategy"] == s]
        ax[0].plot([r["regions"] for r in rs], [r["patch_max_s"] for r in rs], style, label=s)
        ax[1].plot([r["regions"] for r in rs], [r["hub_egress_per_step_gb"] for r in rs], style, label=s)
    ax[0].set(xlabel="regions", ylabel="time to patch, slowest region (s)", yscale="log")
    ax[1].set(xlabel="regions", ylabel="hub egress per step (GB)", yscale="log")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle("1 T-parameter fleet: full broadcast vs sparse delta vs delta + regional relay (model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--from-bench", default=None, help="a bench.wan --json output file (measured overheads)")
    p.add_argument("--params", type=float, default=1e12)
    p.add_argument("--changed", type=float, default=0.015)
    p.add_argument("--step-s", type=float, default=180.0)
    p.add_argument("--keyframe-every", type=int, default=25)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--hub-gbit", type=float, default=100.0)
    p.add_argument("--max-lag", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--regions", default="1,2,5,10,20")
    p.add_argument("--plot", default=None, help="write a PNG here")
    a = p.parse_args(argv)
    inp = Inputs(
        params=a.params,
        changed=a.changed,
        step_s=a.step_s,
        keyframe_every=a.keyframe_every,
        nodes=a.nodes,
        hub_gbit=a.hub_gbit,
        max_lag=a.max_lag,
        steps=a.steps,
    )
    if a.from_bench:
        inp = from_bench(a.from_bench, inp)
    counts = [int(x) for x in a.regions.split(",")]
    rows = table(inp, counts)
    if a.plot:
        plot(rows, a.plot)
    print(
        f"inputs: params={inp.params:.3g} changed={inp.changed} bits/changed={inp.bits_per_changed} "
        f"delta={inp.delta_bytes / 1e9:.2f} GB full={inp.full_bytes / 1e9:.0f} GB step={inp.step_s}s "
        f"nodes/region={inp.nodes} hub={inp.hub_gbit} Gbit/s overhead={inp.overhead:.3f} "
        f"fixed_rtts={inp.fixed_rtts:.2f} ({inp.source})"
    )
    print(
        f"{'strategy':8s} {'regions':>7s} {'patch p50 s':>12s} {'patch max s':>12s} {'egress GB/step':>15s} "
        f"{'> max_lag':>10s}"
    )
    for r in rows:
        print(
            f"{r['strategy']:8s} {r['regions']:7d} {r['patch_p50_s']:12.1f} {r['patch_max_s']:12.1f} "
            f"{r['hub_egress_per_step_gb']:15.1f} {r['beyond_max_lag']:10.1%}"
        )
    if a.json:
        print(json.dumps({"inputs": inp.__dict__, "rows": rows}))


if __name__ == "__main__":
    main()
