"""WorkerConfig: every knob of the rollout worker process, read from TOML then ASYNCRL_* env.

Knobs live in sections (`[worker.engine]`, `[worker.admission]`, ... : rollout_worker/sections.py),
each handed whole to the code that owns it; only the bus and the worker's id sit at the top. A key
of the old flat layout is refused with its new place (MOVED; bus.config). Env overrides nest with
"__": ASYNCRL_ENGINE__SLOTS=16, ASYNCRL_WEIGHTS__PUBLIC_KEY=/etc/asyncrl/keys/trainer-signing.pub.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import ClassVar

from bus import BusConfig
from kernel.config import build_sections, moved_map, same_keys

from .sections import (
    AdmissionSection,
    EngineSection,
    EpisodesSection,
    FaultsSection,
    HarnessSection,
    RunSection,
    WeightsSection,
)

# the flat layout's keys by their new section: {section: {old key: new key}}
_MOVES = {
    "engine": {
        **same_keys(
            "slots",
            "max_len",
            "model",
            "tokenizer",
            "quant_sites",
            "quant_block",
            "seed",
            "update_mode",
            "device",
        ),
        "engine": "kind",
    },
    "admission": same_keys("max_lag", "queue", "max_inflight"),
    "episodes": same_keys(
        "workspace", "docker_image", "sandbox_latency", "episode_wall_s", "allow_weak_sandbox"
    ),
    "harness": {
        **same_keys("endpoint_host", "endpoint_port", "external_deadline_s"),
        "harness": "kind",
        "harness_config": "config",
    },
    "weights": same_keys("public_key"),
    "run": same_keys(
        "threads", "heartbeat_s", "grace_s", "max_restarts", "restart_backoff_s", "metrics_port", "log_level"
    ),
    "faults": {"fault_weights_after": "weights_after"},
}


@dataclass
class WorkerConfig:
    bus: BusConfig = field(default_factory=BusConfig)
    worker_id: str = ""  # default: <host>-<pid>
    engine: EngineSection = field(default_factory=EngineSection)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    episodes: EpisodesSection = field(default_factory=EpisodesSection)
    harness: HarnessSection = field(default_factory=HarnessSection)
    weights: WeightsSection = field(default_factory=WeightsSection)
    run: RunSection = field(default_factory=RunSection)
    faults: FaultsSection = field(default_factory=FaultsSection)

    # old flat key -> "section.key" (bus.config refuses the old one with its new place)
    MOVED: ClassVar[dict[str, str]] = moved_map(_MOVES)

    def __post_init__(self) -> None:
        build_sections(self, "worker")
        if not self.worker_id:
            self.worker_id = f"{socket.gethostname()}-{os.getpid()}"
        # what no single section can see: the admission's defaults and bounds come from the slots
        slots, adm = self.engine.slots, self.admission
        if adm.queue < 0:
            adm.queue = slots // 2
        if adm.max_inflight == 0:
            adm.max_inflight = slots
        if adm.max_inflight < slots:
            raise ValueError(f"max_inflight must be 0 or >= slots ({slots}), got {adm.max_inflight}")
