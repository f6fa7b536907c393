"""ScorerConfig: every knob of the scorer process, read from TOML then ASYNCRL_* env.

Knobs live in sections (`[scorer.reward]`, `[scorer.run]`, `[scorer.sandbox]`: scorer/sections.py),
each handed whole to the code that owns it; only the bus and the scorer's id sit at the top. A key
of the old flat layout is refused with its new place (MOVED; bus.config). Env overrides nest with
"__": ASYNCRL_REWARD__COST_UNIT=wall_s, ASYNCRL_RUN__CONCURRENCY=16, ASYNCRL_RUN__PROVISION=false.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import ClassVar

from bus import BusConfig
from kernel.config import build_sections, moved_map, same_keys

from .sections import RewardSection, RunSection, SandboxSection

# the flat layout's keys by their new section: {section: {old key: new key}}
_MOVES = {
    "reward": same_keys("cost_unit", "default_lambda", "overlong_buffer", "overlong_scale", "episode_reward"),
    "run": same_keys(
        "concurrency",
        "verify_threads",
        "threads",
        "heartbeat_s",
        "grace_s",
        "provision",
        "metrics_port",
        "log_level",
    ),
    "sandbox": same_keys("allow_weak_sandbox"),
}


@dataclass
class ScorerConfig:
    bus: BusConfig = field(default_factory=BusConfig)
    scorer_id: str = ""  # default: scorer-<host>-<pid>
    reward: RewardSection = field(default_factory=RewardSection)
    run: RunSection = field(default_factory=RunSection)
    sandbox: SandboxSection = field(default_factory=SandboxSection)

    # old flat key -> "section.key" (bus.config refuses the old one with its new place)
    MOVED: ClassVar[dict[str, str]] = moved_map(_MOVES)

    def __post_init__(self) -> None:
        build_sections(self, "scorer")
        self.scorer_id = self.scorer_id or f"scorer-{socket.gethostname()}-{os.getpid()}"
        if self.bus.name == BusConfig().name:  # Rl-From header: which scorer published it
            self.bus.name = self.scorer_id
