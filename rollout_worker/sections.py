"""The sections of WorkerConfig (`[worker.<section>]` tables): one config class per piece of code
that owns those knobs, each field's bounds and description on it (kernel.config names the table
and key in every error). Torch-free: `asyncrl config check` and `asyncrl up` build them before any
process starts. What needs two sections (the admission's defaults from the engine's slots) is
resolved by WorkerConfig (rollout_worker/config.py)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import field
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from envs.sandbox_latency import SandboxLatency
from kernel.config import CsvList, config_class

HARNESSES = ("builtin", "mini-swe-agent", "external")


@config_class
class EngineSection:
    """The inference engine (worker.make_engine: rollout_worker/torch_engine.py, or
    rollout_worker/vllm_engine.py, which takes this section whole) and the tokenizer it decodes with."""

    kind: Literal["torch", "vllm"] = "torch"
    slots: Annotated[int, Field(ge=1, description="concurrent sequences (KV cache slots)")] = 8
    max_len: Annotated[int, Field(description="KV positions per slot (0: the model's max_seq_len)")] = 0
    model: Annotated[
        str, Field(description="vllm: HF model dir; torch: unused (the model comes from the keyframe)")
    ] = ""
    tokenizer: Annotated[str, Field(description="char (policy.CharTokenizer) | path to a tokenizer.json")] = (
        "char"
    )
    quant_sites: Annotated[
        CsvList[str], Field(description="policy fp8 fake-quant sites to run (and replay)")
    ] = field(default_factory=list)
    quant_block: int = 0
    seed: int = 0
    update_mode: Annotated[
        str, Field(description="torch: swap (prepare off the decode path) | inline (at the boundary)")
    ] = "swap"
    device: Annotated[
        str,
        Field(
            pattern=r"^(cpu|cuda|cuda:\d+)$",
            description="torch engine: cpu | cuda | cuda:N (weights, KV cache and delta apply there)",
        ),
    ] = "cpu"
    gpu_memory_utilization: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description="vllm: the share of each of its GPUs vLLM may take (weights, KV cache, activations)",
        ),
    ] = 0.9
    tensor_parallel_size: Annotated[
        int,
        Field(
            ge=1,
            description="vllm: GPUs one engine shards its model over (its CUDA_VISIBLE_DEVICES; [layout] "
            "engine_devices); > 1 needs kind = 'vllm'",
        ),
    ] = 1

    @model_validator(mode="after")
    def _tp_needs_vllm(self):
        if self.tensor_parallel_size > 1 and self.kind != "vllm":
            raise ValueError(
                f"tensor_parallel_size = {self.tensor_parallel_size} needs kind = 'vllm' "
                f"(the torch engine runs on one device), got kind={self.kind!r}"
            )
        return self


@config_class
class AdmissionSection:
    """How much work the worker takes (Worker.admissible, Worker.capacity; the consumer loop's
    concurrency and the episode pool are sized from it)."""

    max_lag: Annotated[
        int, Field(ge=0, description="stop admitting while latest_version - my_version > max_lag")
    ] = 4
    queue: Annotated[
        int,
        Field(
            description="sequences allowed to wait for a slot (-1: [worker.engine] slots // 2), keeps "
            "slots full"
        ),
    ] = -1
    max_inflight: Annotated[
        int,
        Field(
            description="episodes in flight at most (0: [worker.engine] slots). An episode waiting on its "
            "command holds a KV row but no decode row (torch engine: kv_slots = this), so > slots keeps "
            "the decoder busy while episodes wait on slow tools, at the memory of the extra KV rows"
        ),
    ] = 0


@config_class
class EpisodesSection:
    """Where multi-turn episodes run (rollout_worker/episodes.py workspace_backend and its runners)."""

    workspace: Annotated[
        Literal["local", "docker"],
        Field(description="episodes' workspaces: local (directories + sandbox) | docker (containers)"),
    ] = "local"
    docker_image: Annotated[
        str, Field(description='workspace="docker": the default image (a task\'s meta["image"] wins)')
    ] = ""
    sandbox_latency: Annotated[
        SandboxLatency,
        Field(
            description="a remote sandbox's test-suite time, modelled (envs/sandbox_latency.py; median_s "
            "0: off): every run_tests and scoring run of a task waits its deterministic lognormal draw"
        ),
    ] = field(default_factory=SandboxLatency)
    episode_wall_s: Annotated[
        float, Field(ge=0, description="> 0: replaces the tasks' episode wall limit (slow sandboxes)")
    ] = 0.0
    allow_weak_sandbox: Annotated[
        bool,
        Field(
            description="start even where the code sandbox lacks isolation layers (envs/isolation.py; "
            "never in production)"
        ),
    ] = False
    envs: Annotated[
        CsvList[str],
        Field(
            description="the environments whose tasks this worker serves ([]: any; `asyncrl up` sets "
            "[trainer.tasks] envs): when none runs code (arithmetic) the sandbox check waits for the "
            "first episode instead of the start"
        ),
    ] = field(default_factory=list)
    task_set: Annotated[
        str,
        Field(
            description="the task set whose repository snapshots this worker's episodes start from (the "
            "`swe` env's [trainer.tasks.swe] task_set; `asyncrl up` sets it): a task whose snapshot lies "
            "outside it is refused. Empty: any"
        ),
    ] = ""

    @field_validator("task_set")
    @classmethod
    def _task_set_is_a_dir(cls, v: str) -> str:
        if v and not os.path.isdir(v):
            raise ValueError(f"[worker.episodes] task_set = {v!r}: no such directory")
        return v


@config_class
class EndpointBounds:
    """What one caller may cost the OpenAI-compatible endpoint (rollout_worker/openai_api.py):
    `[worker.harness.bounds]`. Sized for real harnesses: a whole conversation per request, a few
    harnesses per worker."""

    header_timeout_s: Annotated[
        float, Field(gt=0, description="a connection sends its request's headers within this, else closed")
    ] = 10.0
    body_timeout_s: Annotated[
        float, Field(gt=0, description="and its body within this of the headers (408)")
    ] = 30.0
    max_connections: Annotated[
        int, Field(ge=1, description="open connections at once; more are closed on accept")
    ] = 256
    max_body_bytes: Annotated[int, Field(ge=1024, description="a request body (413 beyond)")] = 8 << 20
    max_messages: Annotated[int, Field(ge=1, description="messages of one chat request")] = 2048
    max_json_depth: Annotated[int, Field(ge=4, le=512, description="nesting of a request body")] = 32
    max_n: Annotated[int, Field(ge=1, le=64, description="choices per request (each a full generation)")] = 4
    max_command_chars: Annotated[int, Field(ge=1, description="one /exec command")] = 64 << 10
    max_adhoc_episodes: Annotated[
        int,
        Field(ge=0, description="requests naming no episode the worker opened: recorders kept at most"),
    ] = 64
    adhoc_idle_s: Annotated[float, Field(gt=0, description="such a recorder unused this long is dropped")] = (
        300.0
    )


LOOPBACK = ("127.0.0.1", "::1", "localhost")


@config_class
class HarnessSection:
    """Who plays multi-turn episodes (worker.make_episode_runner): "builtin"
    (rollout_worker/episodes.py) | "mini-swe-agent" (an external harness the worker launches, through
    the OpenAI-compatible endpoint, rollout_worker/harness.py) | "external" (a harness the worker
    does not launch claims episodes on the endpoint, rollout_worker/external.py)."""

    kind: Literal[HARNESSES] = "builtin"
    config: Annotated[
        str, Field(description="the harness's own config file (mini-swe-agent YAML), merged over ours")
    ] = ""
    endpoint_host: Annotated[
        str, Field(description="the OpenAI-compatible endpoint the harness talks to")
    ] = "127.0.0.1"
    endpoint_port: Annotated[int, Field(ge=0, le=65535, description="0: any free port")] = 0
    external_deadline_s: Annotated[
        float, Field(gt=0, description="external: a claimed episode not ended by then is handed back")
    ] = 600.0
    endpoint_token_file: Annotated[
        str,
        Field(
            description="the endpoint's bearer token(s), one a line, in a file only this uid may read "
            '(0600). Empty: a launched harness gets a fresh token in memory; kind "external" needs one '
            "(`asyncrl up` makes runs/<id>/config/endpoint.token); a path that does not exist yet is "
            "created with a fresh token"
        ),
    ] = ""
    bounds: EndpointBounds = field(default_factory=EndpointBounds)

    @field_validator("config")
    @classmethod
    def _config_is_a_file(cls, v: str) -> str:
        if v and not os.path.isfile(v):
            raise ValueError(f"harness config {v!r} is not a file")
        return v

    @model_validator(mode="after")
    def _package_installed(self):
        if self.kind == "mini-swe-agent" and importlib.util.find_spec("minisweagent") is None:
            raise ValueError(
                "harness 'mini-swe-agent' needs the mini-swe-agent package: pip install 'asyncrl[agents]'"
            )
        return self

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


@config_class
class WeightsSection:
    """Which weights the worker accepts (its weight follower, bus/weight_follower.py)."""

    public_key: Annotated[
        str,
        Field(
            description="the trainer's ed25519 public key(s): hex, or a file holding them (one a line: "
            "both during a key rotation); empty: no signature check"
        ),
    ] = ""


@config_class
class RunSection:
    """This process and its loop (rollout_worker/__main__.py, Worker.run, its supervised tasks)."""

    threads: Annotated[
        int,
        Field(
            description="torch intra-op threads of this process (0: torch's default); `asyncrl up` sets it "
            "from its thread plan (asyncrl/thread_plan.py)"
        ),
    ] = 0
    heartbeat_s: float = 5.0
    grace_s: Annotated[
        float, Field(description="drain: time to finish held tasks before they are nak'ed")
    ] = 30.0
    max_restarts: Annotated[
        int, Field(ge=0, description="a background task failing this many times in a row stops the worker")
    ] = 5
    restart_backoff_s: Annotated[
        float, Field(gt=0, description="first restart delay; doubles per consecutive failure (max 30 s)")
    ] = 0.5
    metrics_port: Annotated[
        int, Field(ge=0, le=65535, description="Prometheus /metrics (kernel.metrics); 0 = off")
    ] = 0
    metrics_host: Annotated[
        str,
        Field(
            description="the address /metrics listens on: loopback unless an operator opens it (a "
            "container's own network: 0.0.0.0, deploy/docker-compose.yml); it has no auth"
        ),
    ] = "127.0.0.1"
    instance: Annotated[
        int,
        Field(
            ge=0,
            description="this process's number among its kind on one host (a systemd unit's %i): "
            "/metrics is served on metrics_port + instance, so several on one host do not collide",
        ),
    ] = 0
    log_level: str = "info"

    @model_validator(mode="after")
    def _port(self):
        if self.metrics_port + self.instance >= 65536:
            raise ValueError(
                f"metrics_port + instance must be a port (< 65536), got metrics_port={self.metrics_port}, "
                f"instance={self.instance}"
            )
        return self


@config_class
class FaultsSection:
    """Fault injection for bench.chaos and tests only: all off in production (not in the docs' tables)."""

    weights_after: Annotated[
        int, Field(ge=0, description="the weight follower fails once, at its Nth update (0: never)")
    ] = 0
