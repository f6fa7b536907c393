"""An OpenAI-compatible HTTP endpoint backed by the worker's engine, recording token-exact trajectories.

    GET  /v1/models
    POST /v1/chat/completions     messages, max_tokens | max_completion_tokens, temperature, top_p,
                                  n, stop, logprobs, seed, stream
    POST /v1/completions          prompt (text or token ids), the same sampling fields, logprobs (int)
    POST /v1/episodes/{id}/end    the harness ends the episode: scored and published (if the worker
                                  opened it with a task), trajectory summary back
    GET  /v1/episodes/{id}        the trajectory so far (ids, mask, versions, counters)

Bring your own harness ([worker.harness] kind = "external"; the worker plays no episode itself):

    POST /v1/episodes             claim the next episode of the worker's task stream. Body (optional):
                                  {"wait_s": 0..60} (default 10). 200: {"episode_id", "task_id", "env",
                                  "messages" (the task's system + user prompt), "sampling", "limits",
                                  "deadline_s", "expires_at", "headers" ({"X-Episode-Id": id}: send it
                                  with every model call), "paths"}; 204: nothing to claim within wait_s
    POST /v1/episodes/{id}/exec   {"command": "..."}: one command as one turn in the episode's sandboxed
                                  workspace (the built-in loop's tools: view, replace, rewrite, run_tests,
                                  submit) -> {"observation", "exit_code", "done", "termination", "turn"};
                                  when the workspace ends the episode (submit, max_turns, timeout) it is
                                  ended as by /end and the response carries its "result"
    POST /v1/episodes/{id}/end    body optional, {"reason": "..."} only (a harness cannot report a reward):
                                  the worker scores the episode with the task's hidden tests from a
                                  pristine tree; 200 after scoring, with "result" (reward, resolved,
                                  tests, termination); the Rollout is published to ROLLOUTS and the
                                  task acked after that, like any episode (trained exactly once)

Each claimed episode is leased for `deadline_s` ([worker.harness] external_deadline_s) from its claim: not
ended by then, it expires and its task goes back to the stream (redelivered, a fresh episode id).
Every route takes `Authorization: Bearer <token>` (one of [worker.harness] endpoint_token_file's,
compared in constant time; 401 otherwise). An episode is open only to the token that claimed it (or,
ad hoc, opened it; the worker's own token for episodes of a harness it launches): another token
gets 404, as for an id that does not exist. Episode ids carry 128 random bits; logs name their first
characters only. What one caller may cost is bounded ([worker.harness.bounds],
rollout_worker/sections.py: EndpointBounds): header and body timeouts, a connection cap, body
size, message count, JSON depth, `n`, ad-hoc recorders (dropped when idle, capped), and a claimed
episode's max_tokens is capped to its turn budget. A claim goes only to a caller still connected:
one that hung up while waiting or before the reply was written leaves the offer to the next caller.

Errors (JSON, OpenAI's shape): 400 malformed body or unknown field (named), 401 no or a wrong
token, 404 unknown episode, 408 body too slow, 413 body too large, 429 ad-hoc episodes full, 409
ended already (the first end's result attached) / not claimed / no model turn to score yet, 410
expired or handed back (later calls of an expired episode get 410, never a fresh ad-hoc episode).
Nothing a refused call sent changes the episode.

Every request belongs to an episode: the `X-Episode-Id` header, else the body's `episode_id`
(extra field), else its `user`; a request naming none gets a new id, returned in the
`X-Episode-Id` response header. Episodes the worker opened keep their KV row between turns;
ad-hoc ones (an id the worker did not open) hold none between requests. Requests of one episode
run one at a time; the recorder
(rollout_worker/trajectory.py) appends the harness's text between turns as observation ids and
keeps the engine's generated ids as the model turns. Generation is the engine's (`generate` with
keep=True, then `extend` of the kept sequence: only the new observation is prefilled), so every
token carries the policy version that produced it and weight updates land between tokens as for
the built-in loop. Streaming sends the finished turn as server-sent events (the engine returns a
whole turn). Responses carry a non-standard `token_ids` per choice (vLLM's name) and, with
logprobs, the behaviour logprob of each sampled token (the sampler's truncated distribution).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import secrets
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import msgspec
from aiohttp import web

from bus.events import SamplingParams
from envs.conversation import chat_format
from kernel import get_logger

from .claims import ANY, ClaimBoard, ClaimError
from .endpoint_token import fresh_token, owner_of
from .http_guard import ConnectionGuard
from .sections import LOOPBACK, EndpointBounds
from .trajectory import RequestError, TrajectoryRecorder, check_messages, encode

log = get_logger(__name__)

MAX_CLAIM_WAIT_S = 60.0
OWNER = web.RequestKey("owner", str)  # the caller's token (endpoint_token.owner_of), set by _gate


def new_episode_id() -> str:
    return f"ep-{secrets.token_hex(16)}"  # 128 random bits: not guessable, not enumerable


def short_id(eid: str | None) -> str:
    """What logs and messages name an episode by: enough to tell episodes apart, not to call one."""
    eid = str(eid or "")
    return eid if len(eid) <= 12 else eid[:11] + "…"


def _field_problem(v, path: str, depth: int, max_depth: int) -> str:
    """Why a decoded JSON body cannot be used ('' if it can): nesting deeper than max_depth, or a
    string that is not valid Unicode (a lone surrogate, from a \\ud800 escape). Iterative: a body
    at the depth limit costs no recursion."""
    todo = [(v, path, depth)]
    while todo:
        v, path, depth = todo.pop()
        if depth > max_depth:
            return f"{path or 'the body'} nests deeper than {max_depth} levels"
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                code = f"\\u{ord(v[e.start]):04x}"
                return f"{path or 'the body'}: a lone surrogate ({code}) at character {e.start}"
        elif isinstance(v, dict):
            todo += [(x, f"{path}.{k}" if path else str(k), depth + 1) for k, x in v.items()]
            todo += [(k, f"{path}{{key}}", depth + 1) for k in v]
        elif isinstance(v, list):
            todo += [(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
    return ""


class OpenAIEndpoint:
    """The endpoint (see the module docstring). `open_episode` registers an episode the worker
    plays (with `on_end` that scores and publishes it); `start()` -> base URL ".../v1"."""

    def __init__(
        self,
        engine,
        tok,
        *,
        model_name: str = "asyncrl-policy",
        host: str = "127.0.0.1",
        port: int = 0,
        default_max_tokens: int = 256,
        fmt=None,
        tokens: list[str] | None = None,
        bounds: EndpointBounds | None = None,
    ):
        """`tokens`: the bearer tokens callers may send (none given: one fresh token, `self.token`,
        for a harness the worker launches); the first is the endpoint's own (`self.token`)."""
        self.engine, self.tok, self.model_name = engine, tok, model_name
        self.host, self.port, self.default_max_tokens = host, port, default_max_tokens
        self.fmt = fmt or chat_format(tok)
        self.bounds = bounds or EndpointBounds()
        tokens = list(tokens or [fresh_token()])
        self.token = tokens[0]
        self._tokens = [(t.encode(), owner_of(t)) for t in tokens]
        self.owner = owner_of(self.token)  # owns the episodes the worker opens for its own harness
        self.episodes: dict[str, TrajectoryRecorder] = {}
        self._adhoc: collections.OrderedDict[str, float] = collections.OrderedDict()  # id -> last use
        self.guard = ConnectionGuard(self.bounds.max_connections, self.bounds.header_timeout_s)
        self._server: asyncio.AbstractServer | None = None
        self.board = ClaimBoard()  # episodes offered to external harnesses (rollout_worker/claims.py)
        self.stats = {
            "requests": 0,
            "bad_requests": 0,
            "episodes_opened": 0,
            "episodes_assigned": 0,
            "episodes_ended": 0,
            "divergent_turns": 0,
            "restarts": 0,
            "tokens": 0,
            "unauthorized": 0,
            "adhoc_dropped": 0,
        }
        self._runner: web.AppRunner | None = None
        self.url = ""
        # tokenising runs on threads of its own, not the loop's default executor: a harness the
        # worker runs in threads (blocking on this endpoint) must never hold the threads its own
        # requests need to be answered
        self._cpu = ThreadPoolExecutor(2, thread_name_prefix="endpoint")

    # -- lifecycle ------------------------------------------------------------------------------
    @web.middleware
    async def _gate(self, request: web.Request, handler):
        """Every route: the connection is busy (no header deadline) while its request runs, and the
        caller's bearer token is checked (constant time, against every token: no early exit)."""
        self.guard.busy(request.transport)
        try:
            got = request.headers.get("Authorization", "")
            scheme, _, cred = got.partition(" ")
            cred_b = cred.strip().encode("utf-8", "replace")
            owner = None
            for tok, who in self._tokens:
                if hmac.compare_digest(cred_b, tok) and scheme.lower() == "bearer":
                    owner = who
            if owner is None:
                self.stats["unauthorized"] += 1
                return web.json_response(
                    {
                        "error": {
                            "message": "missing or wrong bearer token: send 'Authorization: Bearer "
                            "<token>' ([worker.harness] endpoint_token_file; under `asyncrl up`: "
                            "runs/<id>/config/endpoint.token)",
                            "type": "invalid_request_error",
                            "code": "invalid_api_key",
                            "param": "Authorization",
                        }
                    },
                    status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="asyncrl"'},
                )
            request[OWNER] = owner
            return await handler(request)
        finally:
            self.guard.idle(request.transport)

    async def start(self) -> str:
        b = self.bounds
        app = web.Application(client_max_size=b.max_body_bytes, middlewares=[self._gate])
        app.add_routes(
            [
                web.get("/v1/models", self.models),
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                web.post("/v1/episodes", self.claim_http),
                web.post("/v1/episodes/{eid}/exec", self.exec_http),
                web.post("/v1/episodes/{eid}/end", self.end_http),
                web.get("/v1/episodes/{eid}", self.episode_http),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # our own listening socket: aiohttp's protocol behind the connection guard (http_guard.py)
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.factory(self._runner.server), self.host, self.port, backlog=128
        )
        port = self._server.sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}/v1"
        log.info("openai endpoint serving", url=self.url, model=self.model_name)
        if self.host not in LOOPBACK:
            log.warning(
                "the endpoint serves plain HTTP beyond this machine: its bearer token and "
                "trajectories cross the network in clear; put TLS in front or bind 127.0.0.1",
                host=self.host,
            )
        return self.url

    async def close(self) -> None:
        for rec in list(self.episodes.values()):
            self._release(rec)
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._runner is not None:
            await self._runner.shutdown()
            self.guard.close_all()
            await self._runner.cleanup()
            self._runner = None
        self._cpu.shutdown(wait=False, cancel_futures=True)

    # -- episodes -------------------------------------------------------------------------------
    def open_episode(
        self,
        episode_id: str | None = None,
        on_end=None,
        meta: dict | None = None,
        sampling: SamplingParams | None = None,
        owner: str | None = "",
        max_turn_tokens: int = 0,
    ) -> TrajectoryRecorder:
        """`sampling`: the task's; its temperature / top_p / top_k replace the harness's (the
        trainer replays the rollout with the task's sampling parameters). `owner`: the token (its
        owner_of name) whose calls may use the episode; "" (default): the endpoint's own token;
        None: nobody until a harness claims it. `max_turn_tokens` > 0 caps each turn's max_tokens."""
        if episode_id in self.episodes:
            raise ValueError(f"episode {short_id(episode_id)!r} is already open")
        rec = TrajectoryRecorder(self.tok, self.fmt, episode_id or new_episode_id(), on_end, meta)
        rec.sampling = sampling
        rec.owner = self.owner if owner == "" else owner
        rec.max_turn_tokens = max_turn_tokens
        self.episodes[rec.episode_id] = rec
        self.stats["episodes_opened"] += 1
        return rec

    async def end_episode(
        self, episode_id: str, reason: str = "explicit", once: bool = False
    ) -> TrajectoryRecorder:
        """End it once (later calls return the same recorder; with `once`, raise ClaimError 409): the
        kept sequence is released and `on_end(rec)` runs (the worker scores the episode and publishes
        its rollout); what it returns is `rec.result`."""
        rec = self.episodes.get(episode_id)
        if rec is None:
            raise KeyError(episode_id)
        async with rec.lock:
            if rec.ended:
                if once:
                    raise ClaimError(
                        409, f"episode {short_id(episode_id)} has already ended ({rec.end_reason})"
                    )
                return rec
            rec.ended, rec.end_reason = True, reason
            self._release(rec)
        self.stats["episodes_ended"] += 1
        try:
            if rec.on_end is not None:
                rec.result = await rec.on_end(rec)
        finally:
            rec.done.set()
        return rec

    def retire(self, episode_id: str, status: int, message: str, result: dict | None = None) -> None:
        """The episode is gone (ended and scored, expired, handed back): later calls naming it get
        `status` and `message` (see the module docstring)."""
        rec = self.episodes.get(episode_id)
        self.board.retire(episode_id, status, message, result, rec.owner if rec is not None else ANY)
        self.forget(episode_id)

    def forget(self, episode_id: str) -> None:
        self._adhoc.pop(episode_id, None)
        rec = self.episodes.pop(episode_id, None)
        if rec is not None:
            self._release(rec)

    def _adhoc_room(self) -> None:
        """Ad-hoc recorders (a request naming no episode the worker opened) are dropped once idle
        for adhoc_idle_s, and the least recently used idle one goes when max_adhoc_episodes are
        open; all busy: 429. Nobody ends an ad-hoc episode, so without this they would pile up."""
        b, now = self.bounds, time.monotonic()
        for eid, last in list(self._adhoc.items()):
            if len(self._adhoc) < b.max_adhoc_episodes and now - last < b.adhoc_idle_s:
                break
            rec = self.episodes.get(eid)
            if rec is None or not rec.lock.locked():
                self.forget(eid)
                self.stats["adhoc_dropped"] += 1
        if len(self._adhoc) >= b.max_adhoc_episodes:
            raise ClaimError(
                429,
                f"{len(self._adhoc)} ad-hoc episodes are busy (max_adhoc_episodes "
                f"{b.max_adhoc_episodes}): name an episode (X-Episode-Id) or retry later",
            )

    def _release(self, rec: TrajectoryRecorder) -> None:
        if rec.handle is not None and hasattr(self.engine, "release"):
            self.engine.release(rec.handle)
        rec.handle = None

    def _episode_of(self, request: web.Request, body: dict) -> TrajectoryRecorder:
        eid = request.headers.get("X-Episode-Id") or body.get("episode_id") or body.get("user")
        if eid is not None and not (isinstance(eid, str) and 0 < len(eid) <= 200 and eid.isprintable()):
            raise RequestError(
                "episode id (X-Episode-Id, episode_id or user) must be a printable string of "
                "at most 200 characters"
            )
        owner = request[OWNER]
        rec = self.episodes.get(eid) if eid else None
        gone = self.board.retired(eid, owner) if eid else None
        if rec is None and gone is not None:
            raise gone
        if rec is not None and rec.owner != owner:
            if rec.owner is None:  # offered, nobody's yet
                raise ClaimError(
                    409, f"episode {short_id(eid)} is offered but not claimed: POST /v1/episodes first"
                )
            raise ClaimError(404, f"no episode {short_id(eid)} for this token")
        created = rec is None
        if created:
            if eid and self.board.retired(eid) is not None:  # another token's, ended
                raise ClaimError(404, f"no episode {short_id(eid)} for this token")
            self._adhoc_room()
            rec = self.open_episode(eid, owner=owner)
            # nobody ends an ad-hoc episode for sure: it holds no KV row between requests (each
            # request prefills its whole context; the ids are the same either way)
            rec.keep = False
            self.stats["episodes_assigned"] += 1
        if created or rec.episode_id in self._adhoc:
            self._adhoc[rec.episode_id] = time.monotonic()
            self._adhoc.move_to_end(rec.episode_id)
        if rec.ended:
            raise RequestError(f"episode {short_id(rec.episode_id)} has ended")
        return rec

    # -- request parsing ------------------------------------------------------------------------
    def _sampling(self, body: dict, used: int, budget: int = 0) -> tuple[SamplingParams, list[str], int]:
        """`budget` > 0: the episode's turn budget; a larger max_tokens is cut to it (the built-in
        loop's turns are no longer: the harness cannot buy more compute per turn)."""

        def num(key, default, lo, hi, kind=float):
            v = body.get(key, default)
            v = default if v is None else v
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or (kind is int and v != int(v))
                or not lo <= v <= hi
            ):
                raise RequestError(f"{key} must be a {kind.__name__} in [{lo}, {hi}], got {v!r}")
            return kind(v)

        room = self.engine.max_len - used - 1
        if room < 1:
            raise RequestError(
                f"context_length_exceeded: the conversation is {used} tokens, the engine's "
                f"max_len {self.engine.max_len}"
            )
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        want = body.get(key)
        max_tokens = num(key, want or min(self.default_max_tokens, room), 1, 1 << 20, int)
        if budget > 0:
            max_tokens = min(max_tokens, budget)
        if max_tokens > room:
            raise RequestError(
                f"context_length_exceeded: {used} tokens of conversation + max_tokens "
                f"{max_tokens} > the engine's max_len {self.engine.max_len}"
            )
        temperature = num("temperature", 1.0, 0.0, 10.0)
        top_p = num("top_p", 1.0, 1e-6, 1.0)
        n = num("n", 1, 1, self.bounds.max_n, int)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 8 or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop must be a non-empty string or a list of at most 8 of them")
        top_k = num("top_k", 0, 0, 1 << 20, int)  # vLLM's extra field
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, n=n)
        return sp, stop, n

    async def _read(self, request: web.Request) -> bytes:
        """The raw body, within body_timeout_s (408) and max_body_bytes (413)."""
        b = self.bounds
        try:
            return await asyncio.wait_for(request.read(), b.body_timeout_s)
        except TimeoutError:
            raise ClaimError(
                408, f"the body did not arrive within body_timeout_s {b.body_timeout_s}"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise ClaimError(
                413, f"the body is over max_body_bytes {b.max_body_bytes} ([worker.harness.bounds])"
            ) from None

    async def _body(self, request: web.Request) -> dict:
        raw = await self._read(request)
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise RequestError(f"the body is not UTF-8 (byte {e.start})") from None
        except RecursionError:
            raise RequestError(f"the body nests deeper than {self.bounds.max_json_depth} levels") from None
        except ValueError as e:
            raise RequestError(f"the body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        why = _field_problem(body, "", 1, self.bounds.max_json_depth)
        if why:
            raise RequestError(why)
        msgs = body.get("messages")
        if isinstance(msgs, list) and len(msgs) > self.bounds.max_messages:
            raise RequestError(f"messages: {len(msgs)} messages, max_messages {self.bounds.max_messages}")
        if body.get("tools") or body.get("functions"):
            raise RequestError(
                "tools are not supported: use a text-based harness (actions in the message text)"
            )
        return body

    # -- generation -----------------------------------------------------------------------------
    async def _generate(
        self, rec: TrajectoryRecorder, obs: list[int], sp: SamplingParams, stop: list[str], n: int, seed
    ) -> list[tuple]:
        """n choices: (Generation, text, finish). Choice 0 continues the episode (kept sequence);
        others are sampled from the same context and not recorded (the harness continues from one)."""
        stop_seqs = [encode(self.tok, s)[0] for s in stop]
        base = zlib.crc32(f"{rec.episode_id}-{len(rec.turns)}-{seed}".encode())
        if rec.rewound:  # the kept sequence holds the dropped turn: prefill anew
            self._release(rec)
            rec.rewound = False
        if rec.handle is not None and rec.turns and rec.traj is not None:
            g0 = await self.engine.extend(rec.handle, obs, sp, stop_seqs=stop_seqs)
        else:
            if rec.handle is not None:
                self._release(rec)
            ctx = rec.context_ids + obs
            keep = rec.keep and hasattr(self.engine, "extend")
            g0 = await self.engine.generate(ctx, sp, seed=base, keep=keep, stop_seqs=stop_seqs)
            rec.handle = g0.handle if g0.handle >= 0 else None
        ctx = rec.context_ids + obs + g0.completion_ids  # (for the other choices: before g0)
        others = await asyncio.gather(
            *(
                self.engine.generate(
                    ctx[: len(ctx) - len(g0.completion_ids)], sp, seed=base + i, stop_seqs=stop_seqs
                )
                for i in range(1, n)
            )
        )
        out = []
        for g in [g0, *others]:
            text, finish = self._text(g, stop)
            out.append((g, text, finish))
        rec.record(obs, g0, out[0][1])
        self.stats["tokens"] += sum(len(g.completion_ids) for g, _, _ in out)
        return out

    def _text(self, g, stop: list[str]) -> tuple[str, str]:
        """The returned text (eos dropped, cut before a stop string: OpenAI semantics) and finish."""
        ids = g.completion_ids
        eos = getattr(self.tok, "eos_id", None)
        if ids and eos is not None and ids[-1] == eos:
            ids = ids[:-1]
        text = self.tok.decode(ids)
        cut = min((text.find(s) for s in stop if s in text), default=-1)
        if cut >= 0:
            return text[:cut], "stop"
        return text, "length" if g.finish_reason == "length" else "stop"

    def _logprob_entries(self, g) -> list[dict]:
        out = []
        for t, lp in zip(g.completion_ids, g.logprobs):
            s = self.tok.decode([t])
            out.append(
                {"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8")), "top_logprobs": []}
            )
        return out

    # -- handlers -------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "asyncrl",
                        "max_model_len": self.engine.max_len,
                        "version": self.engine.version,
                    }
                ],
            }
        )

    def _error(self, e: Exception, status: int = 400) -> web.Response:
        self.stats["bad_requests"] += 1
        status = getattr(e, "status", status)
        code = (
            "context_length_exceeded"
            if "context_length_exceeded" in str(e)
            else {404: "not_found", 409: "conflict", 410: "gone"}.get(status, "invalid_request_error")
        )
        err = {"message": str(e), "type": "invalid_request_error", "code": code, "param": None}
        if getattr(e, "result", None) is not None:
            err["result"] = e.result
        return web.json_response({"error": err}, status=status)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.stats["requests"] += 1
        try:
            body = await self._body(request)
            if chat:
                messages = check_messages(body.get("messages"))
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]
                if not (isinstance(prompt, str) and prompt) and not (
                    isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
                ):
                    raise RequestError("prompt must be a non-empty string or a list of token ids")
            rec = self._episode_of(request, body)
        except RequestError as e:
            return self._error(e)
        async with rec.lock:
            if rec.ended:
                return self._error(RequestError(f"episode {short_id(rec.episode_id)} has ended"))
            saved = rec.checkpoint()
            before = (rec.stats["divergent_turns"], rec.stats["restarts"])
            try:
                # tokenising a long conversation is CPU work: off the event loop (the body's size is
                # bounded already), so other episodes' requests and the bus keep going meanwhile
                plan = rec.plan_chat if chat else rec.plan_completion
                loop = asyncio.get_running_loop()
                obs = await loop.run_in_executor(self._cpu, plan, messages if chat else prompt)
                sp, stop, n = self._sampling(body, len(rec.context_ids) + len(obs), rec.max_turn_tokens)
                if rec.sampling is not None:
                    task = rec.sampling
                    sp = msgspec.structs.replace(
                        sp, temperature=task.temperature, top_p=task.top_p, top_k=task.top_k
                    )
                choices = await self._generate(rec, obs, sp, stop, n, body.get("seed"))
                rec.stats["requests"] += 1
            except (RequestError, ValueError) as e:  # the engine refuses bad ids / lengths with ValueError
                rec.restore(saved)  # a refused request leaves the episode as it was
                return self._error(e)
        self.stats["divergent_turns"] += rec.stats["divergent_turns"] - before[0]
        self.stats["restarts"] += rec.stats["restarts"] - before[1]
        want_lp = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        headers = {"X-Episode-Id": rec.episode_id}
        usage = {
            "prompt_tokens": len(rec.context_ids) - len(choices[0][0].completion_ids),
            "completion_tokens": sum(len(g.completion_ids) for g, _, _ in choices),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if body.get("stream"):
            return await self._stream(request, rid, chat, choices, want_lp, headers, usage)
        out = []
        for i, (g, text, finish) in enumerate(choices):
            c = {
                "index": i,
                "finish_reason": finish,
                "token_ids": list(g.completion_ids),
                "token_versions": list(g.token_versions),
            }
            if chat:
                c["message"] = {"role": "assistant", "content": text}
                c["logprobs"] = {"content": self._logprob_entries(g)} if want_lp else None
            else:
                c["text"] = text
                c["logprobs"] = (
                    {
                        "tokens": [self.tok.decode([t]) for t in g.completion_ids],
                        "token_logprobs": [float(x) for x in g.logprobs],
                        "top_logprobs": None,
                        "text_offset": [],
                    }
                    if want_lp
                    else None
                )
            out.append(c)
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": out,
                "usage": usage,
                "episode_id": rec.episode_id,
            },
            headers=headers,
        )

    async def _stream(self, request, rid, chat, choices, want_lp, headers, usage) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choice: dict, extra: dict | None = None) -> None:
            d = {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                **(extra or {}),
            }
            await resp.write(f"data: {json.dumps(d)}\n\n".encode())

        for i, (g, text, finish) in enumerate(choices):
            if chat:
                await send({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            # one event per generated token (text up to the stop string)
            sent = 0
            for k, t in enumerate(g.completion_ids):
                piece = (
                    self.tok.decode(g.completion_ids[: k + 1])[sent : len(text)] if sent < len(text) else ""
                )
                sent += len(piece)
                lp = self._logprob_entries(g)[k : k + 1] if want_lp else None
                if chat:
                    c = {
                        "index": i,
                        "delta": {"content": piece},
                        "finish_reason": None,
                        "logprobs": {"content": lp} if lp else None,
                        "token_ids": [t],
                    }
                else:
                    c = {
                        "index": i,
                        "text": piece,
                        "finish_reason": None,
                        "token_ids": [t],
                        "logprobs": {"tokens": [lp[0]["token"]], "token_logprobs": [lp[0]["logprob"]]}
                        if lp
                        else None,
                    }
                await send(c)
            await send(
                {"index": i, "delta": {}, "finish_reason": finish}
                if chat
                else {"index": i, "text": "", "finish_reason": finish}
            )
        await send(
            {"index": 0, "delta": {}, "finish_reason": None}
            if chat
            else {"index": 0, "text": "", "finish_reason": None},
            {"usage": usage},
        )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- external harnesses (rollout_worker/claims.py, rollout_worker/external.py) -------------------
    async def _small_body(self, request: web.Request, fields: dict) -> dict:
        """An optional JSON object with only `fields` (name -> type); RequestError otherwise."""
        if not await self._read(request):
            return {}
        body = await self._body(request)
        for k, v in body.items():
            if k not in fields:
                why = (
                    " (the reward comes from the task's hidden tests)"
                    if "reward" in k or "score" in k
                    else ""
                )
                raise RequestError(f"unknown field {k!r}{why}; allowed: {sorted(fields)}")
            if isinstance(v, bool) or not isinstance(v, fields[k]):
                raise RequestError(f"{k} must be {' or '.join(t.__name__ for t in fields[k])}, got {v!r}")
        return body

    def _claimed(self, eid: str, owner: str):
        """(offer, recorder) of a live episode `owner` claimed; ClaimError otherwise (another
        token's episode: 404, as one that does not exist)."""
        offer, rec = self.board.get(eid), self.episodes.get(eid)
        if offer is None or rec is None:
            gone = self.board.retired(eid, owner)
            raise gone if gone is not None else ClaimError(404, f"no claimed episode {short_id(eid)!r}")
        if offer.owner is None:
            raise ClaimError(
                409, f"episode {short_id(eid)} is offered but not claimed: POST /v1/episodes first"
            )
        if offer.owner != owner:
            raise ClaimError(404, f"no claimed episode {short_id(eid)!r} for this token")
        return offer, rec

    @staticmethod
    def _connected(request: web.Request) -> bool:
        t = request.transport
        return t is not None and not t.is_closing()

    async def claim_http(self, request: web.Request) -> web.Response:
        try:
            if not self.board.enabled:
                raise ClaimError(
                    404,
                    "this worker offers no episodes to external harnesses "
                    '([worker.harness] kind = "external" does)',
                )
            body = await self._small_body(request, {"wait_s": (int, float)})
            wait_s = float(body.get("wait_s", 10.0))
            if not 0 <= wait_s <= MAX_CLAIM_WAIT_S:
                raise RequestError(f"wait_s must be in [0, {MAX_CLAIM_WAIT_S}], got {wait_s}")
        except RequestError as e:
            return self._error(e)
        owner = request[OWNER]
        # reserved, not claimed: the caller must still be there (it may have hung up while waiting)
        offer = await self.board.claim(wait_s, lambda: self._connected(request))
        if offer is None:
            return web.Response(status=204, headers={"Retry-After": "1"})
        eid = offer.episode_id
        rec = self.episodes.get(eid)
        offer.owner = owner
        if rec is not None:
            rec.owner = owner
        base = self.url.rsplit("/v1", 1)[0] if self.url else ""
        resp = web.json_response(
            {
                **offer.info,
                "episode_id": eid,
                "model": self.model_name,
                "deadline_s": offer.deadline_s,
                "expires_at": offer.expires_at,
                "headers": {"X-Episode-Id": eid},
                "paths": {
                    "chat": f"{base}/v1/chat/completions",
                    "completions": f"{base}/v1/completions",
                    "exec": f"{base}/v1/episodes/{eid}/exec",
                    "end": f"{base}/v1/episodes/{eid}/end",
                },
            },
            headers={"X-Episode-Id": eid},
        )
        try:
            if not self._connected(request):
                raise ConnectionResetError("the caller hung up")
            await resp.prepare(request)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError) as e:
            # never delivered: the offer goes to the next caller, as if never claimed
            offer.owner = None
            if rec is not None:
                rec.owner = None
            self.board.release(offer)
            log.info("claim not delivered: offered again", episode_id=short_id(eid))
            if isinstance(e, asyncio.CancelledError):
                raise
            return resp
        self.board.confirm(offer)
        log.info("episode claimed", episode_id=short_id(eid), deadline_s=offer.deadline_s)
        return resp

    async def exec_http(self, request: web.Request) -> web.Response:
        eid = request.match_info["eid"]
        self.stats["requests"] += 1
        try:
            offer, rec = self._claimed(eid, request[OWNER])
            body = await self._small_body(request, {"command": (str,)})
            command = body.get("command", "")
            limit = self.bounds.max_command_chars
            if not command.strip() or len(command) > limit:
                raise RequestError(
                    f"command must be a non-empty string of at most {limit} characters (max_command_chars)"
                )
            if "\x00" in command:
                raise RequestError(
                    f"command: a NUL byte at character {command.index(chr(0))}: no shell can run it"
                )
            if rec.ended:
                raise ClaimError(409, f"episode {short_id(eid)} has ended ({rec.end_reason})")
            out = await offer.execute(command)
            if out["done"]:  # the workspace ended it (submit, max_turns, ...): as an /end
                if rec.traj is not None and any(rec.traj.mask):
                    rec = await self.end_episode(eid, f"workspace: {out['termination']}", once=True)
                    out["result"] = rec.result
                else:
                    out["detail"] = "no model turn to score: the task is handed back at the deadline"
        except RequestError as e:
            return self._error(e)
        return web.json_response(out, headers={"X-Episode-Id": eid})

    async def end_http(self, request: web.Request) -> web.Response:
        eid, owner = request.match_info["eid"], request[OWNER]
        try:
            body = await self._small_body(request, {"reason": (str,)})
            reason = (body.get("reason") or "explicit")[:200]
            if self.board.get(eid) is None and eid not in self.episodes:
                gone = self.board.retired(eid, owner)
                raise gone if gone is not None else ClaimError(404, f"no episode {short_id(eid)!r}")
            if self.board.get(eid) is None:  # an episode the worker opened itself, or ad hoc
                if self.episodes[eid].owner != owner:
                    raise ClaimError(404, f"no episode {short_id(eid)!r} for this token")
                return web.json_response(self.summary(await self.end_episode(eid, reason)))
            _, rec = self._claimed(eid, owner)
            if not rec.ended and (rec.traj is None or not any(rec.traj.mask)):
                raise ClaimError(
                    409,
                    f"episode {short_id(eid)} has no model turn yet: nothing to score (play a turn "
                    f"through /v1/chat/completions with X-Episode-Id first)",
                )
            rec = await self.end_episode(eid, reason, once=True)
        except RequestError as e:
            return self._error(e)
        return web.json_response({**self.summary(rec), "result": rec.result})

    async def episode_http(self, request: web.Request) -> web.Response:
        rec = self.episodes.get(request.match_info["eid"])
        if rec is None or rec.owner != request[OWNER]:
            return web.json_response(
                {"error": {"message": "no such episode", "type": "not_found"}}, status=404
            )
        return web.json_response(self.summary(rec, ids=True))

    def summary(self, rec: TrajectoryRecorder, ids: bool = False) -> dict:
        t = rec.traj
        d = {
            "episode_id": rec.episode_id,
            "ended": rec.ended,
            "end_reason": rec.end_reason,
            "turns": len(rec.turns),
            "model_tokens": sum(t.mask) if t else 0,
            "tokens": len(t.ids) if t else 0,
            **rec.stats,
            **{k: v for k, v in rec.meta.items() if isinstance(v, (str, int, float, bool))},
        }
        if ids and t is not None:
            d.update(
                prompt_ids=t.prompt_ids, ids=t.ids, mask=t.mask, versions=t.versions, logprobs=t.logprobs
            )
        return d
