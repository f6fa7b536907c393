"""mini-swe-agent's environment on this project's episode: its commands run in the sandboxed workspace.

mini-swe-agent (PyPI `mini-swe-agent`, unmodified) takes its environment class from its own
config (`environment.environment_class`, a dotted path); this is that class:

    environment:
      environment_class: envs.mini_swe_agent.SandboxEnvironment
      episode_id: <the id the worker registered the live Episode under>

`execute({"command": ...})` plays the command as one turn of the envs.episode.Episode (the same
limits, sandbox, observation cut and turn accounting as the built-in loop): the output is the
episode's observation. The episode ending ends the agent's run: `submit` (or mini-swe-agent's own
`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`) raises its `Submitted`, any other end (max_turns,
timeout, context, sandbox error) its `LimitsExceeded`. Scoring is not here: the worker scores the
episode with its hidden tests once the agent's run returns.

The Episode object cannot travel through a YAML config, so the worker registers it here under an
id (`register` / `unregister`) and the config names the id.
"""

from __future__ import annotations

import os
import threading
from typing import Any

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # no banner on import

_LIVE: dict[str, Any] = {}
_LOCK = threading.Lock()
SUBMIT_WORDS = ("submit", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")


def register(episode_id: str, episode) -> None:
    with _LOCK:
        if episode_id in _LIVE:
            raise ValueError(f"episode {episode_id!r} is already registered")
        _LIVE[episode_id] = episode


def unregister(episode_id: str) -> None:
    with _LOCK:
        _LIVE.pop(episode_id, None)


def live(episode_id: str):
    with _LOCK:
        ep = _LIVE.get(episode_id)
    if ep is None:
        raise ValueError(f"no live episode {episode_id!r} (the worker registers it before the agent starts)")
    return ep


class SandboxEnvironment:
    """mini-swe-agent Environment protocol: execute / get_template_vars / serialize."""

    def __init__(
        self, *, episode_id: str, timeout: int = 0, env: dict | None = None, cwd: str = "", **_ignored
    ):
        self.episode_id = episode_id
        self.episode = live(episode_id)
        self.config = {"episode_id": episode_id, "cwd": cwd, "env": dict(env or {}), "timeout": timeout}

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        from minisweagent.exceptions import LimitsExceeded, Submitted

        command = (action.get("command") or "").strip()
        ep = self.episode
        if ep.done:
            raise LimitsExceeded(_exit("LimitsExceeded", ep.termination))
        submit = command in SUBMIT_WORDS
        # the turn's length limit is the endpoint's max_tokens; the episode counts the command's tokens
        r = ep.step(
            "```bash\nsubmit\n```" if submit else f"```bash\n{command}\n```",
            n_tokens=ep.count_tokens(command),
        )
        out = {
            "output": r.observation,
            "returncode": int(r.info.get("exit_code", 0) or 0),
            "exception_info": r.info.get("format_error", "") or "",
        }
        if r.done:
            if ep.termination == "submitted":
                raise Submitted(_exit("Submitted", ""))
            raise LimitsExceeded(_exit("LimitsExceeded", f"{ep.termination}: {r.observation[-200:]}"))
        return out

    def get_template_vars(self, **kwargs) -> dict[str, Any]:
        """Template variables for the harness's prompts: episode_system / episode_user are the
        built-in loop's own first two messages for this task and its limits (same prompt either way)."""
        from .episode import initial_messages

        t = self.episode.task
        system, user = initial_messages(t, self.episode.limits)[:2]
        return {
            **self.config,
            "task_id": t.task_id,
            "files": ", ".join(sorted(t.files)),
            "episode_system": system["content"],
            "episode_user": user["content"],
            "fail_to_pass": ", ".join(t.fail_to_pass[:3]),
            "system": "Linux",
            "release": "",
            "version": "",
            "machine": "",
            **kwargs,
        }

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {
                    "environment": dict(self.config),
                    "environment_type": f"{__name__}.{type(self).__name__}",
                }
            }
        }


def _exit(status: str, content: str) -> dict:
    return {"role": "exit", "content": content or status, "extra": {"exit_status": status, "submission": ""}}
