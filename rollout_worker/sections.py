"""The sections of WorkerConfig (`[worker.<section>]` tables): one dataclass per piece of code
that owns those knobs, each checking its own values. Torch-free: `asyncrl config check` and
`asyncrl up` build them before any process starts. What needs two sections (the admission's
defaults from the engine's slots) is resolved by WorkerConfig (rollout_worker/config.py)."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field

from envs.sandbox_latency import SandboxLatency
from kernel.config import check_section

HARNESSES = ("builtin", "mini-swe-agent", "external")


@dataclass
class EngineSection:
    """The inference engine (worker.make_engine: rollout_worker/torch_engine.py, or
    rollout_worker/vllm_engine.py, which takes this section whole) and the tokenizer it decodes with."""

    kind: str = "torch"  # torch | vllm
    slots: int = 8  # concurrent sequences (KV cache slots)
    max_len: int = 0  # KV positions per slot (0: the model's max_seq_len)
    model: str = ""  # vllm: HF model dir; torch: unused (the model comes from the keyframe)
    tokenizer: str = "char"  # char (policy.CharTokenizer) | path to a tokenizer.json
    quant_sites: list[str] = field(default_factory=list)  # policy fp8 fake-quant sites to run (and replay)
    quant_block: int = 0
    seed: int = 0
    update_mode: str = "swap"  # torch: swap (prepare off the decode path) | inline (at the boundary)
    device: str = "cpu"  # torch engine: cpu | cuda | cuda:N (weights, KV cache and delta apply there)
    # vllm: the share of each of its GPUs vLLM may take (weights, KV cache, activations)
    gpu_memory_utilization: float = 0.9
    # vllm: GPUs one engine shards its model over (its CUDA_VISIBLE_DEVICES; [layout] engine_devices)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("torch", "vllm"):
            raise ValueError(f"engine must be 'torch' or 'vllm', got {self.kind!r} ([worker.engine] kind)")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if not (self.device == "cpu" or self.device == "cuda" or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.kind != "vllm":
            raise ValueError(
                f"tensor_parallel_size = {self.tensor_parallel_size} needs kind = 'vllm' "
                "(the torch engine runs on one device)"
            )


@dataclass
class AdmissionSection:
    """How much work the worker takes (Worker.admissible, Worker.capacity; the consumer loop's
    concurrency and the episode pool are sized from it)."""

    max_lag: int = 4  # stop admitting while latest_version - my_version > max_lag
    queue: int = -1  # sequences allowed to wait for a slot (-1: [worker.engine] slots // 2), keeps slots full
    # episodes in flight at most (0: [worker.engine] slots). An episode waiting on its command holds a
    # KV row but no decode row (torch engine: kv_slots = this), so > slots keeps the decoder busy
    # while episodes wait on slow tools, at the memory of the extra KV rows
    max_inflight: int = 0

    def __post_init__(self) -> None:
        if self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {self.max_lag}")


@dataclass
class EpisodesSection:
    """Where multi-turn episodes run (rollout_worker/episodes.py workspace_backend and its runners)."""

    workspace: str = "local"  # episodes' workspaces: local (directories + sandbox) | docker (containers)
    docker_image: str = ""  # workspace="docker": the default image (a task's meta["image"] wins)
    # a remote sandbox's test-suite time, modelled (envs/sandbox_latency.py; median_s 0: off):
    # every run_tests and scoring run of a task waits its deterministic lognormal draw, no local CPU
    sandbox_latency: SandboxLatency = field(default_factory=SandboxLatency)
    episode_wall_s: float = 0.0  # > 0: replaces the tasks' episode wall limit (slow sandboxes)
    # start even where the code sandbox lacks isolation layers (envs/isolation.py; never in production)
    allow_weak_sandbox: bool = False
    # the environments whose tasks this worker serves ([]: any; `asyncrl up` sets [trainer.tasks] envs):
    # when none runs code (arithmetic) the sandbox check waits for the first episode instead of the start
    envs: list[str] = field(default_factory=list)
    # the task set whose repository snapshots this worker's episodes start from (the `swe` env's
    # [trainer.tasks.swe] task_set; `asyncrl up` sets it): a task whose snapshot lies outside it is
    # refused. Empty: any
    task_set: str = ""

    def __post_init__(self) -> None:
        if self.task_set and not os.path.isdir(self.task_set):
            raise ValueError(f"[worker.episodes] task_set = {self.task_set!r}: no such directory")
        if self.workspace not in ("local", "docker"):
            raise ValueError(f"workspace must be 'local' or 'docker', got {self.workspace!r}")
        if isinstance(self.sandbox_latency, dict):
            self.sandbox_latency = SandboxLatency(**self.sandbox_latency)
        if self.episode_wall_s < 0:
            raise ValueError(f"episode_wall_s must be >= 0, got {self.episode_wall_s}")


@dataclass
class EndpointBounds:
    """What one caller may cost the OpenAI-compatible endpoint (rollout_worker/openai_api.py):
    `[worker.harness.bounds]`. Sized for real harnesses: a whole conversation per request, a few
    harnesses per worker."""

    header_timeout_s: float = 10.0  # a connection sends its request's headers within this, else closed
    body_timeout_s: float = 30.0  # and its body within this of the headers (408)
    max_connections: int = 256  # open connections at once; more are closed on accept
    max_body_bytes: int = 8 << 20  # a request body (413 beyond)
    max_messages: int = 2048  # messages of one chat request
    max_json_depth: int = 32  # nesting of a request body
    max_n: int = 4  # choices per request (each a full generation)
    max_command_chars: int = 64 << 10  # one /exec command
    max_adhoc_episodes: int = 64  # requests naming no episode the worker opened: recorders kept at most
    adhoc_idle_s: float = 300.0  # such a recorder unused this long is dropped

    def __post_init__(self) -> None:
        checks = {
            "header_timeout_s": self.header_timeout_s > 0,
            "body_timeout_s": self.body_timeout_s > 0,
            "max_connections": self.max_connections >= 1,
            "max_body_bytes": self.max_body_bytes >= 1024,
            "max_messages": self.max_messages >= 1,
            "max_json_depth": 4 <= self.max_json_depth <= 512,
            "max_n": 1 <= self.max_n <= 64,
            "max_command_chars": self.max_command_chars >= 1,
            "max_adhoc_episodes": self.max_adhoc_episodes >= 0,
            "adhoc_idle_s": self.adhoc_idle_s > 0,
        }
        check_section("worker.harness.bounds", self, checks)


LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class HarnessSection:
    """Who plays multi-turn episodes (worker.make_episode_runner): "builtin"
    (rollout_worker/episodes.py) | "mini-swe-agent" (an external harness the worker launches, through
    the OpenAI-compatible endpoint, rollout_worker/harness.py) | "external" (a harness the worker
    does not launch claims episodes on the endpoint, rollout_worker/external.py)."""

    kind: str = "builtin"
    config: str = ""  # the harness's own config file (mini-swe-agent YAML), merged over ours
    endpoint_host: str = "127.0.0.1"  # the OpenAI-compatible endpoint the harness talks to
    endpoint_port: int = 0  # 0: any free port
    external_deadline_s: float = 600.0  # external: a claimed episode not ended by then is handed back
    # the endpoint's bearer token(s), one a line, in a file only this uid may read (0600). Empty: a
    # launched harness gets a fresh token in memory; kind "external" needs one (`asyncrl up` makes
    # runs/<id>/config/endpoint.token); a path that does not exist yet is created with a fresh token
    endpoint_token_file: str = ""
    bounds: EndpointBounds = field(default_factory=EndpointBounds)

    def __post_init__(self) -> None:
        if self.kind not in HARNESSES:
            raise ValueError(
                f"harness must be 'builtin', 'mini-swe-agent' or 'external', got {self.kind!r} "
                "([worker.harness] kind)"
            )
        if self.external_deadline_s <= 0:
            raise ValueError(f"external_deadline_s must be > 0, got {self.external_deadline_s}")
        if not 0 <= self.endpoint_port <= 65535:
            raise ValueError(f"endpoint_port must be in [0, 65535], got {self.endpoint_port}")
        if isinstance(self.bounds, dict):
            self.bounds = EndpointBounds(**self.bounds)
        if self.config and not os.path.isfile(self.config):
            raise ValueError(f"harness config {self.config!r} is not a file ([worker.harness] config)")
        if self.kind == "mini-swe-agent" and importlib.util.find_spec("minisweagent") is None:
            raise ValueError(
                "harness 'mini-swe-agent' needs the mini-swe-agent package: pip install 'asyncrl[agents]'"
            )

    def token_problem(self) -> str:
        """Why the worker cannot serve its endpoint ('' if it can): an external harness must know
        the token, so it lives in a file (a launched harness gets the worker's own). Checked when
        the worker starts, not here: `asyncrl up` sets the file after checking the config."""
        if self.kind == "external" and not self.endpoint_token_file:
            return (
                'harness "external" needs [worker.harness] endpoint_token_file: the bearer token(s) '
                "its harnesses send (a 0600 file; a path that does not exist yet is created with a "
                "fresh token; `asyncrl up` makes runs/<id>/config/endpoint.token)"
            )
        return ""


@dataclass
class WeightsSection:
    """Which weights the worker accepts (its weight follower, bus/weight_follower.py)."""

    # the trainer's ed25519 public key(s): hex, or a file holding them (one a line: both during a
    # key rotation); empty: no signature check
    public_key: str = ""


@dataclass
class RunSection:
    """This process and its loop (rollout_worker/__main__.py, Worker.run, its supervised tasks)."""

    # torch intra-op threads of this process (0: torch's default); `asyncrl up` sets it from its
    # thread plan (asyncrl/thread_plan.py)
    threads: int = 0
    heartbeat_s: float = 5.0
    grace_s: float = 30.0  # drain: time to finish held tasks before they are nak'ed
    max_restarts: int = 5  # a background task failing this many times in a row stops the worker
    restart_backoff_s: float = 0.5  # first restart delay; doubles per consecutive failure (max 30 s)
    metrics_port: int = 0  # Prometheus /metrics (kernel.metrics); 0 = off
    # the address /metrics listens on: loopback unless an operator opens it (a container's own
    # network: 0.0.0.0, deploy/docker-compose.yml); it has no auth
    metrics_host: str = "127.0.0.1"
    # this process's number among its kind on one host (a systemd unit's %i): /metrics is served on
    # metrics_port + instance, so several on one host do not collide
    instance: int = 0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.restart_backoff_s <= 0:
            raise ValueError(
                f"max_restarts must be >= 0 and restart_backoff_s > 0, got "
                f"{self.max_restarts}, {self.restart_backoff_s}"
            )
        if self.instance < 0 or not 0 <= self.metrics_port + self.instance < 65536:
            raise ValueError(
                f"instance must be >= 0 and metrics_port + instance a port, got instance={self.instance}, "
                f"metrics_port={self.metrics_port} ([worker.run])"
            )


@dataclass
class FaultsSection:
    """Fault injection for bench.chaos and tests only: all off in production (not in the docs' tables)."""

    weights_after: int = 0  # the weight follower fails once, at its Nth update (0: never)

    def __post_init__(self) -> None:
        if self.weights_after < 0:
            raise ValueError(f"weights_after must be >= 0, got {self.weights_after} ([worker.faults])")
