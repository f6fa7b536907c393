"""Where a child's process-wide keys sit in its config table: `threads`, `grace_s` and
`metrics_port` are in [trainer.run] for the trainer, [worker.run] for the rollout worker and
[scorer.run] for the scorer (their configs are in sections: trainer/sections.py,
rollout_worker/sections.py, scorer/sections.py). `up`, its thread plan and its metrics ports read
and set them through here, so they need not know each layout."""

from __future__ import annotations

PROCESS_KEYS = ("threads", "grace_s", "metrics_port")
# component (or run-config table) -> the section holding its process-wide keys ("" = the top)
_SECTION = {"trainer": "run", "worker": "run", "rollout_worker": "run", "scorer": "run"}


def process_table(component: str, conf: dict) -> dict:
    """The (sub)table of `conf` that holds the process-wide keys ({} when it is absent)."""
    sect = _SECTION.get(component, "")
    table = conf.get(sect, {}) if sect else conf
    return table if isinstance(table, dict) else {}


def where(component: str) -> str:
    """The table named in messages: "trainer.run" for the trainer, "worker.run" for a worker,
    "scorer.run" for a scorer (the component itself for one with no section)."""
    sect = _SECTION.get(component, "")
    return f"{component}.{sect}" if sect else component


def get(component: str, conf: dict, key: str, default=None):
    return process_table(component, conf).get(key, default)


def with_keys(component: str, conf: dict, **keys) -> dict:
    """A copy of `conf` with process-wide keys set (each in its place)."""
    sect = _SECTION.get(component, "")
    if not sect:
        return {**conf, **keys}
    return {**conf, sect: {**process_table(component, conf), **keys}}
