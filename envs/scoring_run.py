"""One scoring run of a workspace: pristine copy, the run, and a verdict its code cannot forge.

    status, detail, info = score(task, repo, dest, tools, run, prepare)

1. The scoring copy (envs/scoring_copy.py): the task's snapshot plus the agent's source changes.
2. Tests that are ours and of the supported shape run in value mode (envs/value_tests.py): the
   sandbox reports the values of the calls into the code under test, the asserts are evaluated
   here. Otherwise the task's runner runs them (report mode, envs/workspace_tools.py) and the
   lines are read strictly (envs/test_report.py), with the static and on-disk tamper checks
   (envs/tamper.py).
   Report mode plants honeypot tests (envs/honeypots.py: copies of the task's tests that cannot
   pass where their originals do, a fresh draw a run) and starts the runner isolated, so that no
   file of the workspace can stand in for it (envs/workspace_tools.py: test_command).
3. `info.tampered` names what was found (every test then fails); `info.infra` is set when the
   scoring run could not be made or the sandbox failed: no verdict about the policy.
`run(cmd) -> SandboxResult` runs a command in `dest` in the sandbox; `prepare(dest)` hands the
copy to the sandbox uid.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass

from . import honeypots, scoring_copy, tamper, value_tests
from .test_report import ScoreInfo, read_report
from .workspace_tools import PROBES, REPORT_KEY, test_command, value_command


@dataclass(frozen=True)
class Layers:
    """The verdict's layers, all on in use. The tests switch one off at a time to show what that
    layer alone stops (tests/test_verdict_layers.py); nothing else sets them."""

    value_mode: bool = True  # our tests: values out, asserts evaluated here
    isolated_runner: bool = True  # report mode: `python -I`, the copy after the stdlib on the path
    honeypots: bool = True  # report mode: copies that must fail where their originals pass
    strict_report: bool = True  # the report reader's and the runners' tamper findings count
    static_check: bool = True  # names the agent's change adds (one signal, never alone)


LAYERS = Layers()


def score(task, repo: str, dest: str, tools: str, run, prepare) -> tuple[dict[str, str], str, ScoreInfo]:
    L = LAYERS
    info = ScoreInfo()
    shutil.rmtree(dest, ignore_errors=True)
    nonce = secrets.token_hex(16)
    try:
        snap = scoring_copy.snapshot(task)
        py = {
            r: d.decode("utf-8", "replace") for r, (k, d) in snap.items() if k == "file" and r.endswith(".py")
        }
        plan = value_tests.plan(task, py) if L.value_mode else None
        copy = scoring_copy.build(task, repo, dest, with_tests=plan is None, snap=snap)
        info.dropped, info.n_dropped = copy.dropped, copy.n_dropped
        info.mode = "values" if plan else "runner"
        flags = (
            []
            if plan or not L.static_check
            else tamper.static_flags(task, copy.changed, copy.originals, dest)
        )
        planted = honeypots.Planted()
        if plan is None and L.honeypots:
            tests = {r: t for r, t in py.items() if scoring_copy.is_test_path(r, task)}
            planted = honeypots.plant(task, tests, secrets.SystemRandom())
            for rel, text in planted.files.items():
                with open(os.path.join(dest, rel), "w", encoding="utf-8") as f:
                    f.write(text)
            snap = {**snap, **{r: ("file", t.encode("utf-8")) for r, t in planted.files.items()}}
        written = {
            r: d
            for r, (k, d) in snap.items()
            if k == "file"
            and scoring_copy.infra_kind(r, task)
            and (plan is None or not scoring_copy.is_test_path(r, task))
        }
        own = sorted({r.split("/")[0].removesuffix(".py") for r in snap if "/" in r or r.endswith(".py")})
        key, body = (
            (PROBES, {**plan.job(nonce), "own": own})
            if plan
            else (
                REPORT_KEY,
                {
                    "nonce": nonce,
                    "own": own,
                    "tests": tamper.tests_digest(task, snap),
                    **tamper.checker_key(task, copy.changed, copy.originals),
                },
            )
        )
        with open(os.path.join(dest, key), "w") as f:
            json.dump(body, f)
        prepare(dest)
    except (OSError, ValueError) as e:
        info.infra = "scoring_copy"
        return {}, f"scoring copy failed: {e}", info
    res = run(
        value_command(tools)
        if plan
        else test_command(task.runner, task.test_paths, tools, report=True, isolated=L.isolated_runner)
    )
    if res.reason.startswith("sandbox error"):
        info.infra = "sandbox"
        return {}, f"tests: {res.reason}", info
    flags += tamper.run_flags(task, dest, written)
    rep = read_report(res.stdout.decode("utf-8", "replace"), nonce, task.runner)
    detail = "" if res.ok or res.reason.startswith("exit code") else f"tests: {res.reason}"
    if plan:
        status, first = plan.evaluate(rep.values) if rep.complete and rep.values is not None else ({}, "")
        detail = "; ".join(x for x in (detail, first[:300]) if x)
    else:
        status = rep.verdict_status() if L.strict_report else dict(rep.status)
        status, honey = planted.judge(status)
        if rep.complete:
            flags += honey
    if not rep.complete and not rep.tampered:
        detail = "; ".join(x for x in (detail, "the test run did not finish") if x)
    why = (rep.tampered if L.strict_report else []) + flags
    if why:
        info.tampered = "; ".join(why[:3])[:500]
        status = {t: "FAIL" for t in status}
    return status, detail, info
