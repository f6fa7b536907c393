"""`asyncrl config check` over every shipped run config (deploy/*.toml) gives the verdict it gave
before the configs were pydantic classes and the run a typed tree (asyncrl/runconfig.py): the same
exit status, and for a refusal the same reason. Two refusals depend on files this checkout lacks:
run-gpu.toml's tokenizer (/models/policy) and swe-import.toml's task set (tasks/swe-import)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.config_sections import ROOT, clean_env, run_config_check

# file -> (exit status, a piece of the refusal); what `config check` said on the configs before
VERDICTS = {
    "cost-smollm2.toml": (0, None),
    "cost-swe-demo.toml": (0, None),
    "demo.toml": (0, None),
    "learn-smollm2-code.toml": (0, None),
    "learn-smollm2-harder.toml": (0, None),
    "learn-smollm2.toml": (0, None),
    "run-gpu.toml": (
        2,
        "[trainer.tasks] chat_template = true: no tokenizer.json in /models/policy/tokenizer.json",
    ),
    "run.toml": (0, None),
    "smollm2.toml": (0, None),
    "swe-demo.toml": (0, None),
    "swe-import.toml": (2, "[trainer.tasks.swe] task_set = 'tasks/swe-import': no such directory"),
}
NEEDS = {"run-gpu.toml": Path("/models/policy"), "swe-import.toml": ROOT / "tasks" / "swe-import"}


def test_every_shipped_run_config_has_a_verdict():
    assert {p.name for p in (ROOT / "deploy").glob("*.toml")} == set(VERDICTS)


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_config_check_verdict_of_a_shipped_run_config(name):
    if name in NEEDS and NEEDS[name].exists():
        pytest.skip(f"{NEEDS[name]} exists here: the refusal recorded is about its absence")
    rc, reason = VERDICTS[name]
    r = run_config_check(ROOT / "deploy" / name, env=clean_env())
    assert r.returncode == rc, r.stdout[-1000:] + r.stderr[-2000:]
    if reason is None:
        assert "ok: settings agree across processes" in r.stdout, r.stdout[-2000:]
    else:
        assert reason in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
