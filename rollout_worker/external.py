"""Episodes played by a harness the worker does not launch (bring your own harness).

    [worker.harness] kind = "external"        external_deadline_s = 600   endpoint_port = 8100

The worker takes tasks from TASKS exactly as for its own loop (same capacity, same lease: the
consumer loop keeps the message in progress while the episode lives, acks it only after the
Rollout is published). Per episode of a task:

    Episode reset (workspace)    the task's sandboxed workspace, as for the built-in loop
    endpoint.open_episode(id)    the model calls naming the id (X-Episode-Id) are recorded token-exact
    board.offer(id)              waits for a harness: POST /v1/episodes hands it out (messages,
                                 sampling, limits; never the task's spec or hidden tests)
    exec                         POST /v1/episodes/{id}/exec: one command, one Episode.step (the
                                 built-in loop's sandbox, tools, limits and turn accounting)
    end                          POST /v1/episodes/{id}/end (or the workspace ending it): the
                                 hidden tests score a pristine tree with the agent's edits
                                 (Episode.score); the harness gets the result; one Rollout from the
                                 recorded trajectory (model ids as generated, observations masked,
                                 per-token versions) -> the worker publishes it, then acks the task
    deadline                     not ended `external_deadline_s` after its claim: the episode
                                 expires (later calls: 410), its workspace goes, and the task is
                                 nak'ed (TransientError) so the stream redelivers it: a fresh episode

An unclaimed offer holds its task for as long as the worker holds it (the lease is renewed; a
worker that dies or drains hands it back).
"""

from __future__ import annotations

import asyncio
import time

from bus import TransientError
from bus.events import Rollout, SamplingParams, Task
from kernel import get_logger

from .claims import ClaimError
from .harness import EndpointRunner
from .openai_api import new_episode_id, short_id
from .trajectory import count_episode, rollout_of

log = get_logger(__name__)

EXPIRED = "expired"
# what a harness learns of its episode's score: the verdict and counts, never the hidden tests'
# ids (nor the scoring run's detail or the dropped files' names)
RESULT_KEYS = ("task_id", "reward", "resolved", "termination", "turns", "tool_calls", "format_errors")


def harness_result(result, rollout_id: str) -> dict:
    d = result.to_dict()
    out = {k: d[k] for k in RESULT_KEYS}
    out.update(
        tests_passed=sum(bool(v) for v in d["tests"].values()),
        tests_total=len(d["tests"]),
        tampered=bool(d.get("tampered")),
        infra_error=d.get("infra_error", ""),
        rollout_id=rollout_id,
    )
    return out


class ExternalRunner(EndpointRunner):
    """Episodes played by whoever claims them on the endpoint (a harness the worker does not launch)."""

    def __init__(self, engine, tok, *, deadline_s: float = 600.0, **kw):
        super().__init__(engine, tok, **kw)
        if deadline_s <= 0:
            raise ValueError(f"external_deadline_s must be > 0, got {deadline_s}")
        self.deadline_s = deadline_s
        self.endpoint.board.enabled = True
        self.stats.update(offered=0, expired=0, handed_back=0)
        # per delivered task (its Task object): the offers not claimed yet and the runs waiting on them
        self._unclaimed: dict[int, dict[str, tuple]] = {}

    async def run(self, task: Task, sp: SamplingParams, index: int) -> Rollout:
        await self.url()  # (the worker serves before taking tasks; this is a no-op then)
        _, limits, ep, _ = self.open(task)
        eid = new_episode_id()  # 128 random bits; a redelivered task: a fresh id
        sid = short_id(eid)
        loop = asyncio.get_running_loop()
        ended, scored = loop.create_future(), loop.create_future()
        lock = asyncio.Lock()  # one workspace call at a time (steps, then score/close)
        rec = None

        async def on_end(r) -> dict | None:  # the endpoint calls it once, for whoever ended it
            if not ended.done():
                ended.set_result(r.end_reason)
            if r.end_reason == EXPIRED:
                return None
            try:
                return await asyncio.shield(scored)
            except asyncio.CancelledError:
                if scored.cancelled():  # the worker let the task go (drain) before scoring it
                    raise ClaimError(410, f"episode {sid} was handed back by the worker") from None
                raise

        async def execute(command: str) -> dict:
            async with lock:
                if rec.ended or ep.done:
                    raise ClaimError(409, f"episode {sid} has ended ({ep.termination or rec.end_reason})")
                submit = command.strip() == "submit"
                r = await self.pool.step(
                    ep,
                    "```bash\nsubmit\n```" if submit else f"```bash\n{command}\n```",
                    ep.count_tokens(command),
                )
            return {
                "observation": r.observation,
                "exit_code": r.info.get("exit_code"),
                "done": r.done,
                "termination": ep.termination or None,
                "turn": ep.turns,
                "format_error": r.info.get("format_error"),
            }

        t0 = time.perf_counter()
        try:
            msgs = await self.pool.reset(ep)
            rec = self.endpoint.open_episode(
                eid,
                on_end=on_end,
                meta={"task_id": task.task_id},
                sampling=sp,
                owner=None,  # the claiming harness's token, at the claim
                max_turn_tokens=min(sp.max_tokens, limits.max_turn_tokens),
            )
            info = {
                "task_id": task.task_id,
                "env": task.env,
                "sample_index": index,
                "messages": msgs,
                "sampling": {
                    "temperature": sp.temperature,
                    "top_p": sp.top_p,
                    "top_k": sp.top_k,
                    "max_tokens": min(sp.max_tokens, limits.max_turn_tokens),
                },
                "limits": {
                    "max_turns": limits.max_turns,
                    "max_turn_tokens": limits.max_turn_tokens,
                    "max_context_tokens": limits.max_context_tokens,
                    "episode_wall_s": limits.episode_wall_s,
                },
            }
            offer = self.endpoint.board.offer(eid, info, execute, self.deadline_s)
            self.stats["offered"] += 1
            unclaimed = self._unclaimed.setdefault(id(task), {})
            unclaimed[eid] = (offer, asyncio.current_task())
            await offer.claimed.wait()
            unclaimed.pop(eid, None)
            try:
                await asyncio.wait_for(asyncio.shield(ended), self.deadline_s)
            except TimeoutError:
                await self.endpoint.end_episode(eid, EXPIRED)  # unless the harness's end won the race
            if await ended == EXPIRED:
                async with lock:  # a command in flight finishes before the workspace goes
                    self.stats["expired"] += 1
                # the task goes back whole: its siblings nobody claimed go with it (the redelivery
                # offers them anew); claimed ones play on and publish (rollout ids dedupe)
                for o, run in list(self._unclaimed.get(id(task), {}).values()):
                    if not o.claimed.is_set():
                        run.cancel()
                self.endpoint.retire(
                    eid,
                    410,
                    f"episode {sid} expired: not ended within {self.deadline_s}s "
                    f"of its claim; its task went back to the stream",
                )
                log.warning(
                    "external episode expired; task handed back", episode_id=sid, task_id=task.task_id
                )
                raise TransientError(
                    f"episode {sid} expired (no end within {self.deadline_s}s of its claim)", delay=0
                )
            try:
                async with lock:
                    result = await self.pool.score(ep)
                res = harness_result(result, f"{task.task_id}-{index}")
            except BaseException as e:
                scored.set_exception(
                    ClaimError(
                        503,
                        f"scoring episode {sid} failed ({type(e).__name__}); "
                        f"its task goes back to the stream",
                    )
                )
                raise
            scored.set_result(res)
            self.endpoint.retire(eid, 409, f"episode {sid} has already ended ({rec.end_reason})", res)
        finally:
            group = self._unclaimed.get(id(task), {})
            group.pop(eid, None)
            if not group:
                self._unclaimed.pop(id(task), None)
            if rec is not None and eid in self.endpoint.episodes:
                # cancelled (the worker drains) or failed before an end: nobody may continue it
                self.stats["handed_back"] += 1
                self.endpoint.retire(eid, 410, f"episode {sid} was handed back by the worker")
            self.endpoint.board.withdraw(eid)
            if not scored.done():
                scored.cancel()
            async with lock:
                await self.pool.close(ep)
        count_episode(self.stats, self.ended, rec, result, time.perf_counter() - t0, rec.end_reason)
        return rollout_of(
            task,
            sp,
            index,
            rec,
            result,
            self.tok,
            self.worker_id,
            {"harness": "external", "harness_exit": {"exit_status": rec.end_reason}},
        )
