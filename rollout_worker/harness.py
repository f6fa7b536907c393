"""Episodes played by an external agent harness through the worker's OpenAI-compatible endpoint.

    [worker.harness] kind = "mini-swe-agent"      (default "builtin": rollout_worker/episodes.py's loop)

Per episode (same task stream, same books as the built-in loop):

    Episode reset (workspace)  -> registered for envs.mini_swe_agent.SandboxEnvironment
    endpoint.open_episode(id)  -> the harness's model calls (X-Episode-Id) are recorded token-exact
    the harness runs in a thread: mini-swe-agent, unmodified, built from its own config only
                                   (model: litellm_textbased, api_base = the endpoint; environment:
                                   the adapter) until it submits or stops
    endpoint.end_episode(id)   -> the kept KV row is released
    Episode.score()            -> hidden tests; one Rollout from the recorded trajectory: model ids
                                   as generated, observations masked (version -1), per-token versions

The harness config is mini-swe-agent's YAML (`[worker.harness] config`, merged over DEFAULT_CONFIG); the
runner sets only the model's api_base / model name / episode header and the environment's class
and episode id.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from concurrent.futures import ThreadPoolExecutor

from bus.events import Rollout, SamplingParams, Task

from .episodes import EpisodeRunner
from .openai_api import OpenAIEndpoint, new_episode_id, short_id
from .sections import EndpointBounds
from .trajectory import count_episode, rollout_of

HARNESSES = ("builtin", "mini-swe-agent")

# mini-swe-agent's config: the built-in loop's own prompts for the task (the adapter's template
# variables; a policy trained on either loop sees the same text), this project's ```bash actions
DEFAULT_CONFIG = {
    "agent": {
        "system_template": "{{episode_system}}",
        "instance_template": "{{episode_user}}",
        "step_limit": 15,
        "cost_limit": 0.0,
        "max_consecutive_format_errors": 3,
    },
    "model": {
        "model_class": "litellm_textbased",
        "action_regex": r"```bash\s*\n(.*?)\n```",
        "format_error_template": "Reply with exactly one ```bash block.",
        "observation_template": "{{output.output}}",
        "cost_tracking": "ignore_errors",
        "model_kwargs": {"temperature": 1.0, "drop_params": True},
    },
    "environment": {"environment_class": "envs.mini_swe_agent.SandboxEnvironment"},
}


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        both = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = _merge(out[k], v) if both else copy.deepcopy(v)
    return out


def load_harness_config(path: str = "") -> dict:
    """DEFAULT_CONFIG with the YAML file at `path` merged over it (ValueError: unreadable)."""
    if not path:
        return copy.deepcopy(DEFAULT_CONFIG)
    import yaml

    try:
        with open(path) as f:
            user = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"[worker.harness] config {path}: {e}") from None
    if not isinstance(user, dict) or set(user) - {"agent", "model", "environment", "run"}:
        raise ValueError(
            f"[worker.harness] config {path}: expected mini-swe-agent sections agent/model/environment"
        )
    return _merge(DEFAULT_CONFIG, user)


def episode_config(
    base: dict, url: str, model_name: str, episode_id: str, max_tokens: int, api_key: str
) -> dict:
    """The harness's own config for one episode: its model points at the endpoint (with the
    endpoint's bearer token: litellm sends `api_key` as `Authorization: Bearer`, as OPENAI_API_KEY
    would), its environment at the live episode."""
    cfg = copy.deepcopy(base)
    m = cfg["model"]
    m["model_name"] = f"openai/{model_name}"  # litellm's OpenAI-compatible provider
    kw = m.setdefault("model_kwargs", {})
    kw.update(api_base=url, api_key=api_key, extra_headers={"X-Episode-Id": episode_id})
    kw.setdefault("max_tokens", max_tokens)
    cfg["environment"]["episode_id"] = episode_id
    return cfg


def run_mini_swe_agent(cfg: dict, task_text: str) -> dict:
    """One run of mini-swe-agent's DefaultAgent (blocking: the worker calls it in a thread);
    {"exit_status", "submission"}, or the exception's name as the exit status."""
    # the package's own switches: no banner, no network for litellm's price map, one try per call
    # (the endpoint is local: a refused request is not transient)
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    import litellm

    litellm.suppress_debug_info = True  # no "Provider List" banner per call (our model has no price)
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models import get_model

    model = get_model(config=cfg["model"])
    env = get_environment(cfg["environment"])
    agent = DefaultAgent(model, env, **cfg["agent"])
    try:
        info = agent.run(task=task_text)
    except Exception as e:  # the agent re-raises what it cannot handle
        return {"exit_status": type(e).__name__, "submission": "", "error": str(e)[:500]}
    return {"exit_status": info.get("exit_status", ""), "submission": info.get("submission", "")}


class EndpointRunner(EpisodeRunner):
    """EpisodeRunner's books (stats, ended records, parse, open) with the turns played through the
    worker's OpenAI-compatible endpoint, which it owns: started once, on first use."""

    def __init__(
        self,
        engine,
        tok,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "asyncrl-policy",
        tokens: list[str] | None = None,
        bounds: EndpointBounds | None = None,
        **kw,
    ):
        super().__init__(engine, tok, **kw)
        self.endpoint = OpenAIEndpoint(
            engine,
            tok,
            host=host,
            port=port,
            model_name=model_name,
            fmt=self.fmt,
            tokens=tokens,
            bounds=bounds,
        )
        self._started: asyncio.Future | None = None

    async def url(self) -> str:
        """The endpoint's base URL (".../v1"); concurrent first callers share one start."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.endpoint.start())
        return await asyncio.shield(self._started)

    async def close(self) -> None:
        await self.endpoint.close()


class HarnessRunner(EndpointRunner):
    """Episodes played by a harness the worker launches (mini-swe-agent) against the endpoint."""

    def __init__(self, engine, tok, *, harness: str = "mini-swe-agent", harness_config: str = "", **kw):
        super().__init__(engine, tok, **kw)
        if harness not in HARNESSES[1:]:
            raise ValueError(f"harness must be one of {HARNESSES}, got {harness!r}")
        self.harness, self.config = harness, load_harness_config(harness_config)
        # one thread per episode in flight, apart from the loop's default executor: a blocking
        # harness run there would starve whatever else awaits a thread (weight updates, the sandbox)
        self._threads = ThreadPoolExecutor(self.pool.max_workers, thread_name_prefix="harness")

    async def close(self) -> None:
        await super().close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def run(self, task: Task, sp: SamplingParams, index: int) -> Rollout:
        from envs import mini_swe_agent

        et, limits, ep, _ = self.open(task)
        eid = new_episode_id()  # a redelivered task: a fresh id
        url = await self.url()
        budget = min(sp.max_tokens, limits.max_turn_tokens)
        rec = self.endpoint.open_episode(
            eid, meta={"task_id": task.task_id}, sampling=sp, max_turn_tokens=budget
        )
        t0 = time.perf_counter()
        exit_info: dict = {}
        try:
            await self.pool.reset(ep)
            mini_swe_agent.register(eid, ep)
            try:
                cfg = episode_config(
                    self.config, url, self.endpoint.model_name, eid, budget, self.endpoint.token
                )
                loop = asyncio.get_running_loop()
                exit_info = await loop.run_in_executor(self._threads, run_mini_swe_agent, cfg, et.instruction)
            finally:
                mini_swe_agent.unregister(eid)
            await self.endpoint.end_episode(eid, exit_info.get("exit_status", ""))
            result = await self.pool.score(ep)
        finally:
            self.endpoint.forget(eid)
            await self.pool.close(ep)
        if rec.traj is None or not rec.traj.ids:
            raise ValueError(f"the harness ended episode {short_id(eid)} without a model turn ({exit_info})")
        count_episode(
            self.stats, self.ended, rec, result, time.perf_counter() - t0, exit_info.get("exit_status", "")
        )
        return rollout_of(
            task,
            sp,
            index,
            rec,
            result,
            self.tok,
            self.worker_id,
            {"harness": self.harness, "harness_exit": exit_info},
        )
