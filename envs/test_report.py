"""Reading a scoring run's report lines (envs/workspace_tools.py writes them) into a verdict.

    <nonce> <seq> PASS|FAIL|SKIP <test id>     one line per test, each test once
    <nonce> <seq> VALUES <json>                value mode: the probes' values (envs/value_tests.py)
    <nonce> <seq> TAMPER <what>                a runner's integrity check found something
    <nonce> <seq> END <n test lines>           last

Anything else carrying the nonce is evidence of forging, never a result: a line out of sequence,
a test reported twice, a line after END, a malformed line, the nonce anywhere but at the start of
a report line, a count at END that disagrees, or (pytest) a test reported PASS that pytest's own
terminal summary does not list as PASSED / XPASS or lists as FAILED / ERROR. Such a run is
`tampered`: every test counts as failed. A run without END did not finish (timeout, crash,
os._exit): every test counts as failed too (`complete` False), since whatever ran last could have
written the lines before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

STATUSES = ("PASS", "FAIL", "SKIP")
SUMMARY = re.compile(r"^=+ short test summary info =+$")
SUMMARY_KINDS = ("PASSED", "FAILED", "ERROR", "XPASS", "XFAIL", "SKIPPED")


@dataclass
class ScoreInfo:
    """What a workspace's last scoring run found besides the statuses (Episode.score reads it)."""

    dropped: list[str] = field(default_factory=list)  # agent files kept out of the scoring copy
    n_dropped: int = 0
    tampered: str = ""  # why the verdict was judged forged ("" if not)
    infra: str = ""  # an infrastructure failure ("" if none)
    mode: str = ""  # "values" | "runner"


@dataclass
class Report:
    status: dict[str, str] = field(default_factory=dict)  # test id -> PASS | FAIL | SKIP
    values: list | None = None  # value mode: [[test id, [probe result]]]
    tampered: list[str] = field(default_factory=list)  # why the lines cannot be believed
    complete: bool = False  # END seen

    def verdict_status(self) -> dict[str, str]:
        """What scoring may believe: nothing passes when tampered or incomplete."""
        if self.tampered or not self.complete:
            return {t: "FAIL" for t in self.status}
        return dict(self.status)


def read_report(output: str, nonce: str, runner: str = "mini") -> Report:
    rep = Report()
    lines = output.splitlines()
    seq, end_at, n_tests = 0, None, 0
    for i, line in enumerate(lines):
        if nonce not in line:
            continue
        if not line.startswith(nonce + " "):
            rep.tampered.append("the nonce appeared outside a report line")
            continue
        parts = line.split(" ", 3)
        if len(parts) != 4 or not parts[1].isdigit():
            rep.tampered.append("malformed report line")
            continue
        _, n, kind, rest = parts
        if end_at is not None:
            rep.tampered.append("a report line after the end of the run")
            continue
        seq += 1
        if int(n) != seq:
            rep.tampered.append(f"report lines out of sequence ({n} where {seq} was due)")
        if kind in STATUSES:
            n_tests += 1
            if rest in rep.status:
                rep.tampered.append(f"{rest} reported twice")
                rep.status[rest] = "FAIL"
            else:
                rep.status[rest] = kind
        elif kind == "VALUES":
            if rep.values is not None:
                rep.tampered.append("values reported twice")
            try:
                import json

                rep.values = json.loads(rest)
            except ValueError:
                rep.tampered.append("unreadable values")
        elif kind == "TAMPER":
            rep.tampered.append(rest[:200])
        elif kind == "END":
            end_at = i
            if rest.strip() != str(n_tests):
                rep.tampered.append(
                    f"the runner ended after {rest.strip()[:20]} test lines, {n_tests} were read"
                )
        else:
            rep.tampered.append(f"unknown report kind {kind[:20]!r}")
    rep.complete = end_at is not None
    if runner == "pytest" and rep.complete and not rep.tampered:
        rep.tampered += cross_check_summary(lines[:end_at], rep.status)
    rep.tampered = list(dict.fromkeys(rep.tampered))
    return rep


def cross_check_summary(lines: list[str], status: dict[str, str]) -> list[str]:
    """pytest's terminal summary (the last one before END) against the plugin's lines: a second
    channel a forger of one of them leaves behind."""
    start = max((i for i, ln in enumerate(lines) if SUMMARY.match(ln)), default=None)
    term: dict[str, set[str]] = {}
    for ln in lines[start + 1 :] if start is not None else []:
        kind, _, rest = ln.partition(" ")
        if kind in SUMMARY_KINDS:
            for key in {rest, rest.split(" - ")[0], rest.split(" ")[0]}:
                term.setdefault(key, set()).add(kind)
    passed = [t for t, s in status.items() if s == "PASS"]
    bad = [t for t in passed if not term.get(t, set()) & {"PASSED", "XPASS"} or term[t] & {"FAILED", "ERROR"}]
    if bad:
        return [
            f"{len(bad)} test(s) reported passing that pytest's summary does not pass (e.g. {bad[0][:120]})"
        ]
    after = lines[start + 1 :] if start is not None else []
    n_term = sum(1 for ln in after if ln.startswith(("PASSED ", "XPASS ")))
    if n_term != len(passed):
        return [f"pytest's summary passes {n_term} tests, the report {len(passed)}"]
    return []


def parse_report(output: str, nonce: str, runner: str = "mini") -> dict[str, str]:
    """{test id: PASS|FAIL|SKIP} that scoring may believe (see read_report)."""
    return read_report(output, nonce, runner).verdict_status()
