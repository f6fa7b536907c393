"""Validation of injected bugs: run a candidate's tests in the sandbox and keep it only when the
original passes and the mutant breaks something; and the counts the builders report."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .episode import EpisodeLimits, EpisodeTask
from .mutations import KINDS
from .sandbox import BashLimits

# validation runs trusted-but-mutated code: a mutant may loop forever, so the limits still hold
VALIDATION_LIMITS = EpisodeLimits(score_wall_s=30.0, command=BashLimits(wall_s=30.0, cpu_s=30))


def run_suite(
    files: dict[str, str],
    runner: str,
    test_paths: list[str],
    base_dir: str | None = None,
    limits: EpisodeLimits | None = None,
    backend=None,
    env_dir: str | None = None,
) -> tuple[dict[str, str], str]:
    """{test id: PASS|FAIL|SKIP} of `files` (over `base_dir`) under the task's runner, in the sandbox
    (with the repository's environment `env_dir`, when given)."""
    from .workspace import LocalBackend

    limits = limits or VALIDATION_LIMITS
    task = EpisodeTask(
        "validation",
        "validation",
        "train",
        "",
        files,
        {},
        runner,
        test_paths,
        [],
        [],
        base_dir,
        env_dir=env_dir,
    )
    ws = (backend or LocalBackend()).create(task, limits)
    try:
        if ws.error:
            return {}, ws.error
        status, detail = ws.run_hidden_tests(task, limits)
        forged = getattr(getattr(ws, "score_info", None), "tampered", "")
        return status, "; ".join(x for x in (detail, f"tampered: {forged}" if forged else "") if x)
    finally:
        ws.close()


def fail_pass_split(original: dict[str, str], mutant: dict[str, str]) -> tuple[list[str], list[str]]:
    """(fail-to-pass, pass-to-pass) over the tests the original passes."""
    ok = [t for t, s in original.items() if s == "PASS"]
    return [t for t in ok if mutant.get(t) != "PASS"], [t for t in ok if mutant.get(t) == "PASS"]


@dataclass
class BuildReport:
    """What a builder tried and kept, per family and per mutation kind."""

    tried: Counter = field(default_factory=Counter)  # (family, kind) -> mutants validated
    kept: Counter = field(default_factory=Counter)  # (family, kind) -> tasks kept
    splits: Counter = field(default_factory=Counter)  # (family, split) -> tasks
    notes: list[str] = field(default_factory=list)

    def add(self, family: str, kind: str, kept: bool, split: str | None = None) -> None:
        self.tried[family, kind] += 1
        if kept:
            self.kept[family, kind] += 1
            self.splits[family, split] += 1

    def merge(self, other: BuildReport) -> BuildReport:
        self.tried.update(other.tried)
        self.kept.update(other.kept)
        self.splits.update(other.splits)
        self.notes += other.notes
        return self

    def to_dict(self) -> dict:
        fams = sorted({f for f, _ in self.tried} | {f for f, _ in self.splits})
        out = {}
        for f in fams:
            tried = sum(v for (g, _), v in self.tried.items() if g == f)
            kept = sum(v for (g, _), v in self.kept.items() if g == f)
            out[f] = {
                "tasks": kept,
                "tried": tried,
                "kept_fraction": round(kept / tried, 3) if tried else None,
                "splits": {s: v for (g, s), v in self.splits.items() if g == f},
                "by_kind": {
                    k: {"tried": self.tried[f, k], "kept": self.kept[f, k]}
                    for k in (*KINDS, "stub")
                    if self.tried[f, k]
                },
            }
        return {"families": out, "total_tasks": sum(self.kept.values()), "notes": self.notes}

    def render(self) -> str:
        d = self.to_dict()
        lines = [f"{'family':<16}{'kind':<20}{'tried':>7}{'kept':>7}{'kept %':>8}"]
        for f, v in d["families"].items():
            for k, c in v["by_kind"].items():
                lines.append(
                    f"{f:<16}{k:<20}{c['tried']:>7}{c['kept']:>7}{100 * c['kept'] / c['tried']:>7.0f}%"
                )
            frac = v["kept_fraction"]
            lines.append(
                f"{f:<16}{'(all)':<20}{v['tried']:>7}{v['tasks']:>7}"
                f"{(100 * frac if frac is not None else 0):>7.0f}%   splits {v['splits']}"
            )
        lines.append(f"total tasks: {d['total_tasks']}")
        return "\n".join(lines + d["notes"])
