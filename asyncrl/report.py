"""End of an `asyncrl up` run: plots from the metrics JSONL and a summary table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["t"], r[key]) for r in rows if r.get(key) is not None]
    if not pts:
        return np.zeros(0), np.zeros(0)
    t, v = zip(*pts)
    return np.asarray(t, float), np.asarray(v, float)


def at_version_time(rows: list[dict]) -> list[dict]:
    """Rows to plot: an eval run after the run (`eval_initial`, `eval_final`) placed at the time its
    version was made (v0: where RL started), not at the end, sorted by that time."""
    made = {r["version"]: r["t"] for r in rows if "samples" in r}
    ws = next((r for r in rows if r.get("warmstart_steps_done") is not None), None)
    made.setdefault(0, ws["t"] if ws is not None else 0.0)
    out = [
        {**r, "t": made.get(r.get("version"), r["t"])} if r.get("eval_initial") or r.get("eval_final") else r
        for r in rows
    ]
    return sorted(out, key=lambda r: r["t"])


def _smooth(v: np.ndarray, k: int = 5) -> np.ndarray:
    if len(v) < k:
        return v
    return np.convolve(v, np.ones(k) / k, mode="valid")


def staleness_hist(rows: list[dict]) -> dict[int, int]:
    """Trained samples per staleness (versions behind): the sum of the per-step histograms."""
    hist: dict[int, int] = {}
    for r in rows:
        for lag, c in (r.get("staleness_hist") or {}).items():
            hist[int(lag)] = hist.get(int(lag), 0) + int(c)
    return hist


def plot_run(run_dir: Path, rows: list[dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    rows = at_version_time(rows)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [
        (
            axes[0, 0],
            [
                ("reward_mean", "reward"),
                ("success_mean", "success (train)"),
                ("eval_success", "success (held-out)"),
                ("warmstart_check_success", "success (warm-start check, train split)"),
            ],
            "reward / success vs time",
        ),
        (axes[0, 1], [("cost_mean", "tokens per answer")], "tokens per answer vs time"),
        (axes[1, 0], [("k3_mean", "mismatch KL (k3)")], "trainer/sampler mismatch"),
        (axes[1, 1], [("changed_frac", "changed fraction")], "delta: changed fraction of bf16 weights"),
        (axes[1, 2], [("delta_ratio", "delta bytes / full bf16 bytes")], "delta size ratio"),
    ]
    for ax, keys, title in panels:
        for key, label in keys:
            t, v = _series(rows, key)
            if len(v) and key.startswith(("eval_", "warmstart_")):  # few points: draw them all, unsmoothed
                ax.plot(t, v, "o-", label=label)
            elif len(v):
                ax.plot(t, v, ".", alpha=0.3)
                sv = _smooth(v, 15)
                ax.plot(t[len(t) - len(sv) :], sv, label=label)
        ax.set_title(title)
        ax.set_xlabel("seconds")
        if ax.get_legend_handles_labels()[1]:  # (a panel with no series yet: no legend, no warning)
            ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    ws = next((r for r in rows if r.get("warmstart_steps_done") is not None), None)
    if ws is not None:  # RL starts here
        axes[0, 0].axvline(ws["t"], color="gray", ls="--", lw=1)
        axes[0, 0].annotate(
            f"warm start: {ws['warmstart_steps_done']} steps",
            (ws["t"], 0.02),
            fontsize=7,
            rotation=90,
            xycoords=("data", "axes fraction"),
        )
    hist = staleness_hist(rows)
    ax = axes[0, 2]
    if hist:
        lags = sorted(hist)
        ax.bar(lags, [hist[k] for k in lags])
    ax.set_title("staleness of trained tokens (versions behind)")
    ax.set_xlabel("version lag")
    fig.tight_layout()
    p = run_dir / "plots" / "run.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    out.append(str(p))
    return out


def summary_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="asyncrl run summary")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in summary.items():
        if isinstance(v, (dict, list)):
            continue
        t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    Console(stderr=True).print(t)


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file ([] when it does not exist yet)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_trainer_metrics(run_dir: Path) -> list[dict]:
    """The trainer's own per-step record (and eval rows), with t = seconds since its first row."""
    rows = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    t0 = rows[0].get("ts", 0.0) if rows else 0.0
    for r in rows:
        r["t"] = r.get("ts", t0) - t0
    return rows


def finish_run(run_dir: Path, reason: str, extra: dict | None = None) -> dict:
    """Plots and summary.json; `extra` (e.g. the supervisor's restarts) is recorded with it."""
    rows = read_trainer_metrics(run_dir)
    plots = plot_run(run_dir, rows) if rows else []
    steps = [r for r in rows if "samples" in r]
    last = steps[-1] if steps else {}
    # by version (the after-run evals of the initial and the last policy land in either order), then row order
    evals = sorted((r for r in rows if r.get("eval_success") is not None), key=lambda r: r.get("version", 0))
    first_eval, last_eval = (evals[0], evals[-1]) if evals else ({}, {})
    ws = next((r for r in rows if r.get("warmstart_steps_done") is not None), {})
    checks = [
        [r["warmstart_step"], r["warmstart_check_success"]] for r in rows if "warmstart_check_success" in r
    ]
    summary = {
        "run_dir": str(run_dir),
        "stopped": reason,
        "versions": last.get("version", 0),
        "trainer_steps": len(steps),
        "warmstart_steps_done": ws.get("warmstart_steps_done"),
        "warmstart_stopped": ws.get("warmstart_stopped"),
        "warmstart_check_success_last": ws.get("warmstart_check_success_last"),
        "warmstart_checks": checks,  # [step, train-split success] of each stop check
        "eval_success_initial": first_eval.get("eval_success"),
        "eval_success_final": last_eval.get("eval_success"),
        "eval_version_final": last_eval.get("version"),  # ([up] final_eval: the version the run ended at)
        "eval_tokens_initial": first_eval.get("eval_tokens"),
        "eval_tokens_final": last_eval.get("eval_tokens"),
        "reward_last": last.get("reward_mean"),
        "success_last": last.get("success_mean"),
        "tokens_per_answer_last": last.get("cost_mean"),
        "staleness_mean_last": last.get("staleness_mean"),
        "k3_mean_last": last.get("k3_mean"),
        "delta_ratio_last": last.get("delta_ratio"),
        "plots": plots,
        **(extra or {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    summary_table(summary)
    return summary
