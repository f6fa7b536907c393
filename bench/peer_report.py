"""bench.peer's reader: held-out success against training wall clock for asyncrl and TRL, compared.

Pure functions over the evaluated policies ({"side", "wall_s", "success", ...} rows, as
bench.peer_eval returns them), plus the plot:

curves(rows)              side -> [(wall_s, success)], sorted by wall clock
pick_versions(rows, ...)  the asyncrl versions to evaluate: the first at or past each clock mark
reach_s(curve, target)    the first wall time the curve reaches target, interpolated (rules below)
compare(rows)             TRL's best held-out success, each side's time to reach it, the ratio
plot(rows, result, path)  success vs wall clock, both sides, the target and the reach times

Interpolation: a side's curve is piecewise linear between its evaluated points, starting from the
shared starting policy at 0 s. It reaches `target` at its first point at or above it or, when the
point before is below, where the segment between them crosses target (linear in wall time). TRL's
own best is reached at its first point with that success (no segment can cross a maximum earlier).
`reach_point_s` is the same without interpolation (the first evaluated point at or above target):
with evaluation points ~60 s apart the two differ by at most one interval. A side whose curve never
reaches target has no reach time; the ratio is then only bounded: at least its last evaluated
wall time over TRL's reach time (`ratio_at_least`).
"""

from __future__ import annotations

from pathlib import Path

SIDES = ("asyncrl", "trl")
INTERPOLATION = (
    "piecewise linear between evaluated points (from the shared start at 0 s): the first crossing "
    "of target; reach_point_s: the first evaluated point at or above target"
)


def curves(rows: list[dict]) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {s: [] for s in SIDES}
    for r in rows:
        out.setdefault(r["side"], []).append((float(r["wall_s"]), float(r["success"])))
    return {s: sorted(c) for s, c in out.items()}


def pick_versions(rows: list[dict], every_s: float, budget_s: float) -> list[dict]:
    """From the trainer's per-version rows ({"version", "lead_wall_s"}; the first row of a version
    counts), the first version at or past each mark every_s, 2·every_s, ... up to budget_s, and the
    last version within budget_s: the same marks TRL saves at."""
    first: dict[int, float] = {}
    for r in rows:
        if r.get("lead_wall_s") is not None and int(r["version"]) not in first:
            first[int(r["version"])] = float(r["lead_wall_s"])
    made = sorted((t, v) for v, t in first.items() if t <= budget_s)
    picked, mark = [], every_s
    for t, v in made:
        if t >= mark:
            picked.append({"version": v, "wall_s": t})
            mark = (int(t // every_s) + 1) * every_s
    if made and (not picked or picked[-1]["version"] != made[-1][1]):
        picked.append({"version": made[-1][1], "wall_s": made[-1][0]})
    return picked


def reach_s(curve: list[tuple[float, float]], target: float) -> float | None:
    """First wall time the piecewise-linear curve reaches target (None: never)."""
    for i, (t, s) in enumerate(curve):
        if s >= target:
            if i == 0:
                return t
            t0, s0 = curve[i - 1]
            return t0 + (target - s0) / (s - s0) * (t - t0)
    return None


def reach_point_s(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, s in curve if s >= target), None)


def best(curve: list[tuple[float, float]]) -> tuple[float, float]:
    """(wall_s, success) of the highest success, the first such point."""
    top = max(s for _, s in curve)
    return next((t, s) for t, s in curve if s == top)


def compare(rows: list[dict]) -> dict:
    """TRL's best held-out success as the target; each side's time to reach it; asyncrl/TRL."""
    c = curves(rows)
    for side in SIDES:
        if not c.get(side):
            raise ValueError(f"no evaluated {side} policy in the rows")
    best_t, target = best(c["trl"])
    out: dict = {"target": target, "target_is": "TRL's best held-out success", "interpolation": INTERPOLATION}
    for side in SIDES:
        bt, bs = best(c[side])
        out[side] = {
            "start": c[side][0][1],
            "best": bs,
            "best_wall_s": bt,
            "last_wall_s": c[side][-1][0],
            "points": len(c[side]),
            "reach_s": reach_s(c[side], target),
            "reach_point_s": reach_point_s(c[side], target),
        }
    a, t = out["asyncrl"]["reach_s"], out["trl"]["reach_s"]
    out["ratio"] = out["ratio_at_least"] = out["speedup"] = None
    if t is None or t <= 0:
        out["note"] = "TRL never rose above the starting policy: no time to compare"
    elif a is None:
        out["ratio_at_least"] = out["asyncrl"]["last_wall_s"] / t
        out["note"] = f"asyncrl did not reach {target:.3f} in its {out['asyncrl']['last_wall_s']:.0f} s"
    else:
        out["ratio"] = a / t
        out["speedup"] = t / a if a > 0 else None
    return out


def plot(rows: list[dict], result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = curves(rows)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = {"asyncrl": "tab:blue", "trl": "tab:orange"}
    for side in SIDES:
        ts, ss = [t for t, _ in c[side]], [s for _, s in c[side]]
        ax.plot(ts, ss, "o-", color=colors[side], label=f"{side} (best {result[side]['best']:.3f})")
        r = result[side]["reach_s"]
        if r is not None:
            ax.axvline(r, color=colors[side], ls=":", lw=1)
    ax.axhline(result["target"], color="grey", ls="--", lw=1, label=f"target {result['target']:.3f}")
    ratio = result.get("ratio")
    title = f"time to TRL's best: asyncrl/TRL = {ratio:.2f}" if ratio is not None else "held-out success"
    ax.set(xlabel="training wall clock (s)", ylabel="held-out success", ylim=(0, 1), title=title)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
