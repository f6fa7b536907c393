"""WorkerConfig: every knob of the rollout worker process, read from TOML then ASYNCRL_* env.

Knobs live in sections (`[worker.engine]`, `[worker.admission]`, ... : rollout_worker/sections.py),
each handed whole to the code that owns it; only the bus and the worker's id sit at the top. Env
overrides nest with "__": ASYNCRL_ENGINE__SLOTS=16,
ASYNCRL_WEIGHTS__PUBLIC_KEY=/etc/asyncrl/keys/trainer-signing.pub.
"""

from __future__ import annotations

import os
import socket
from dataclasses import field
from typing import Annotated, ClassVar

from pydantic import Field

from bus import BusConfig
from kernel.config import config_class

from .sections import (
    AdmissionSection,
    EngineSection,
    EpisodesSection,
    FaultsSection,
    HarnessSection,
    RunSection,
    WeightsSection,
)


@config_class
class WorkerConfig:
    TABLE: ClassVar[str] = "worker"  # in the errors of a direct construction

    bus: BusConfig = field(default_factory=BusConfig)
    worker_id: Annotated[str, Field(description="default: <host>-<pid>")] = ""
    engine: EngineSection = field(default_factory=EngineSection)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    episodes: EpisodesSection = field(default_factory=EpisodesSection)
    harness: HarnessSection = field(default_factory=HarnessSection)
    weights: WeightsSection = field(default_factory=WeightsSection)
    run: RunSection = field(default_factory=RunSection)
    faults: FaultsSection = field(default_factory=FaultsSection)

    def __post_init__(self) -> None:
        if not self.worker_id:
            self.worker_id = f"{socket.gethostname()}-{os.getpid()}"
        # what no single section can see: the admission's defaults and bounds come from the slots
        slots, adm = self.engine.slots, self.admission
        if adm.queue < 0:
            adm.queue = slots // 2
        if adm.max_inflight == 0:
            adm.max_inflight = slots
        if adm.max_inflight < slots:
            raise ValueError(
                f"[worker.admission] max_inflight must be 0 or >= [worker.engine] slots ({slots}), "
                f"got {adm.max_inflight}"
            )
