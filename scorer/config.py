"""ScorerConfig: every knob of the scorer process, read from TOML then ASYNCRL_* env.

Knobs live in sections (`[scorer.reward]`, `[scorer.run]`, `[scorer.sandbox]`: scorer/sections.py),
each handed whole to the code that owns it; only the bus and the scorer's id sit at the top. Env
overrides nest with "__": ASYNCRL_REWARD__COST_UNIT=wall_s, ASYNCRL_RUN__CONCURRENCY=16,
ASYNCRL_RUN__PROVISION=false.
"""

from __future__ import annotations

import os
import socket
from dataclasses import field
from typing import Annotated, ClassVar

from pydantic import Field

from bus import BusConfig
from kernel.config import config_class

from .sections import RewardSection, RunSection, SandboxSection


@config_class
class ScorerConfig:
    TABLE: ClassVar[str] = "scorer"  # in the errors of a direct construction

    bus: BusConfig = field(default_factory=BusConfig)
    scorer_id: Annotated[str, Field(description="default: scorer-<host>-<pid>")] = ""
    reward: RewardSection = field(default_factory=RewardSection)
    run: RunSection = field(default_factory=RunSection)
    sandbox: SandboxSection = field(default_factory=SandboxSection)

    def __post_init__(self) -> None:
        self.scorer_id = self.scorer_id or f"scorer-{socket.gethostname()}-{os.getpid()}"
        if self.bus.name == BusConfig().name:  # Rl-From header: which scorer published it
            self.bus.name = self.scorer_id
