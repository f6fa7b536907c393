"""The token-exact trajectory of an episode played by an external harness through the endpoint.

A harness (mini-swe-agent, SWE-agent, an in-house loop) re-sends the whole conversation as text on
every call. The recorder turns each request into token ids without re-tokenising what the model
wrote:

    conversation  = prompt, model turn 1, between 1, model turn 2, between 2, ...   (chat template
                    or PlainFormat, rendered with a marker in place of each assistant message)
    model turn k  = the ids the engine generated for turn k, whatever text the harness sends back
                    (a harness that edits or strips it: `divergent_turns` counts it, the ids stay)
    between k     = what the harness appended after turn k (tool output, the template's turn
                    markers): tokenised once, when it first appears, kept as observation ids
                    (loss mask 0, version -1, no behaviour logprob)

The same request sent again (a client retry: the harness never saw the last turn) drops that
turn and generates it anew (`retried_turns`). A request whose earlier part does not equal what
was recorded otherwise (the harness dropped or rewrote history) cannot continue the sampled
sequence: the recorder starts over from that request's whole
context as a prompt (`restarts`, `dropped_model_tokens`), so the rollout never holds an id the
sampler did not produce under the context it was trained with. An assistant message the server
never generated (a harness-written demonstration) is context, not a model turn (`foreign_turns`).

Per token of the trajectory: loss mask, behaviour logprob, sampling-mask row, policy version, as
the built-in loop records them (rollout_worker/episodes.py: Trajectory).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from bus.rollout_build import build_rollout
from envs.conversation import PlainFormat

from .episodes import Trajectory

_MARK = "\x00asyncrl-assistant-{}\x00"
ROLES = ("system", "user", "assistant", "tool", "developer")


class RequestError(ValueError):
    """A request the endpoint refuses (HTTP `status`, 400 unless a subclass says), with the reason."""

    status = 400


def message_text(m: dict) -> str:
    """A message's text: a string, or OpenAI content parts of type text."""
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in c):
        return "".join(str(p.get("text", "")) for p in c)
    raise RequestError("message content must be a string or text parts (no images, no tool calls)")


def check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}]: need a role of system|user|assistant|tool|developer")
        if m.get("tool_calls"):
            raise RequestError(f"messages[{i}]: tool calls are not supported; use a text-based harness")
        out.append({"role": m["role"], "content": message_text(m)})
    return out


def render_split(fmt, tok, messages: list[dict]) -> tuple[list[str], list[str]]:
    """(chunks, assistant contents): the rendered conversation (generation prompt included) cut at
    each assistant message, so chunks[k] is the text between assistant message k and k+1."""
    marked, contents = [], []
    for m in messages:
        if m["role"] == "assistant":
            marked.append({"role": "assistant", "content": _MARK.format(len(contents))})
            contents.append(m["content"])
        else:
            marked.append(m)
    if isinstance(fmt, PlainFormat):
        text = "".join(f"{m['role'].upper()}:\n{m['content']}\n\n" for m in marked) + "ASSISTANT:\n"
    else:
        text = tok.render_chat(marked, add_generation_prompt=True)
    chunks = []
    for k in range(len(contents)):
        head, sep, text = text.partition(_MARK.format(k))
        if not sep:
            raise RequestError("the chat template dropped an assistant message: cannot record the turn")
        chunks.append(head)
    chunks.append(text)
    return chunks, contents


def encode(tok, text: str, bos: bool = False) -> tuple[list[int], int]:
    """(ids, characters replaced): a char-level tokenizer has no id for some characters (tabs,
    non-ASCII tool output); they become '?' instead of failing the harness's request."""
    stoi = getattr(tok, "stoi", None)
    n = 0
    if stoi is not None:
        bad = {c for c in text if c not in stoi}
        if bad:
            n = sum(text.count(c) for c in bad)
            text = "".join("?" if c in bad else c for c in text)
    return tok.encode(text, bos=bos), n


@dataclasses.dataclass
class Turn:
    start: int  # index in traj.ids of the turn's first generated id
    end: int
    text: str  # what the endpoint returned for it (stop sequence removed)


class TrajectoryRecorder:
    """One episode's conversation as ids (see the module docstring). Requests of one episode are
    serialised by `lock`; `on_end` (async, the recorder) runs once when the episode ends."""

    def __init__(self, tok, fmt, episode_id: str | None = None, on_end=None, meta: dict | None = None):
        self.tok, self.fmt = tok, fmt
        self.episode_id = episode_id or f"ep-{uuid.uuid4().hex[:16]}"
        self.on_end, self.meta = on_end, dict(meta or {})
        self.lock = asyncio.Lock()
        self.traj: Trajectory | None = None
        self.turns: list[Turn] = []
        self.handle: int | None = None  # the engine's kept sequence (torch/vLLM `extend`)
        self.keep = True  # keep the KV row between turns (episodes the worker opened)
        self.sampling = None  # the task's SamplingParams (worker-opened episodes)
        self.ended, self.end_reason = False, ""
        self.stats = {
            "requests": 0,
            "divergent_turns": 0,
            "restarts": 0,
            "dropped_model_tokens": 0,
            "foreign_turns": 0,
            "replaced_chars": 0,
            "retried_turns": 0,
        }
        self.rewound = False  # the last turn was dropped: the kept KV row is stale
        self._divergent: set[int] = set()
        self.done = asyncio.Event()
        self.result = None  # what on_end returned (an external episode's score)

    def checkpoint(self) -> tuple:
        """What a request may change before it generates (restore() undoes a refused one)."""
        t = self.traj
        lists = None if t is None else tuple(list(x) for x in (t.ids, t.mask, t.logprobs, t.versions, t.rows))
        return t, lists, list(self.turns), set(self._divergent), dict(self.stats), self.rewound

    def restore(self, saved: tuple) -> None:
        self.traj, lists, self.turns, self._divergent, self.stats, self.rewound = saved
        if lists is not None:
            self.traj.ids, self.traj.mask, self.traj.logprobs, self.traj.versions, self.traj.rows = lists

    # -- ids of a request ---------------------------------------------------------------------
    @property
    def context_ids(self) -> list[int]:
        return [] if self.traj is None else self.traj.prompt_ids + self.traj.ids

    def _enc(self, text: str, bos: bool = False) -> list[int]:
        ids, n = encode(self.tok, text, bos)
        self.stats["replaced_chars"] += n
        return ids

    def _after_turn(self, k: int, chunk: str) -> str:
        """A chunk that follows model turn k, less the end-of-turn text the model already sampled."""
        eos = getattr(self.tok, "eos_id", None)
        t = self.turns[k]
        if eos is not None and t.end > t.start and self.traj.ids[t.end - 1] == eos:
            e = self.tok.decode([eos])
            if e and chunk.startswith(e):
                return chunk[len(e) :]
        return chunk

    def plan_chat(self, messages: list[dict]) -> list[int]:
        """The ids to append before generating (observation ids), after matching the conversation
        against what was recorded; starts the trajectory (or over) where it must."""
        chunks, contents = render_split(self.fmt, self.tok, messages)
        if self.traj is not None:
            n = len(self.turns)
            ok = len(contents) >= n and self._enc(chunks[0], bos=True) == self.traj.prompt_ids
            for k in range(n if ok else 0):
                if contents[k] != self.turns[k].text and k not in self._divergent:
                    self._divergent.add(k)  # keep the ids; count the drift once
                    self.stats["divergent_turns"] += 1
                if k + 1 < n:  # the text between two recorded turns must be what was recorded
                    between = self.traj.ids[self.turns[k].end : self.turns[k + 1].start]
                    if self._enc(self._after_turn(k, chunks[k + 1])) != between:
                        ok = False
                        break
            if not ok and self._is_retry(chunks, contents):
                # the same request again (the harness never got turn n: a client timeout, a retry):
                # turn n is dropped (never seen, never trained) and generated anew
                t = self.turns.pop()
                self.stats["retried_turns"] += 1
                self.stats["dropped_model_tokens"] += t.end - t.start
                for name in ("ids", "mask", "logprobs", "versions", "rows"):
                    setattr(self.traj, name, getattr(self.traj, name)[: t.start])
                self.rewound = True
                return []
            if ok:
                if n == 0:  # no turn yet (a retried first request): same prompt, nothing to add
                    tail = "".join(_interleave(chunks[1:], contents))
                    self.stats["foreign_turns"] += len(contents)
                    return self._enc(tail) if tail else []
                rest = _interleave(chunks[n + 1 :], contents[n:])
                self.stats["foreign_turns"] += len(contents) - n
                return self._enc(self._after_turn(n - 1, chunks[n]) + "".join(rest))
            self.stats["restarts"] += 1
            self.stats["dropped_model_tokens"] += sum(self.traj.mask)
        # a new trajectory: the whole conversation is the prompt (earlier assistant text included)
        self.stats["foreign_turns"] += len(contents)
        self.traj = Trajectory(self._enc(chunks[0] + "".join(_interleave(chunks[1:], contents)), bos=True))
        self.turns, self._divergent = [], set()
        return []

    def _is_retry(self, chunks: list[str], contents: list[str]) -> bool:
        """The request that produced the last recorded turn, sent again."""
        n = len(self.turns)
        if n == 0 or len(contents) != n - 1 or self._enc(chunks[0], bos=True) != self.traj.prompt_ids:
            return False
        for k in range(n - 1):
            lo = self.turns[k].end
            hi = self.turns[k + 1].start
            if self._enc(self._after_turn(k, chunks[k + 1])) != self.traj.ids[lo:hi]:
                return False
        return self.turns[0].start == 0 if n == 1 else True

    def plan_completion(self, prompt) -> list[int]:
        """/v1/completions: a text prompt is matched as text against the recorded text (each
        recorded id decoded), token-id prompts as ids; the new suffix is observation ids."""
        if isinstance(prompt, list):
            ids = [int(t) for t in prompt]
            ctx = self.context_ids
            if self.traj is not None and ids[: len(ctx)] == ctx:
                return ids[len(ctx) :]
            if self.traj is not None:
                self._restart()
            self.traj = Trajectory(ids)
            self.turns = []
            return []
        if self.traj is not None:
            # the text of the context as the harness saw it: prompt text, then per model turn the
            # text returned, between turns the recorded observation text
            text = self.tok.decode(self.traj.prompt_ids)
            pos = 0
            for t in self.turns:
                text += self.tok.decode(self.traj.ids[pos : t.start]) + t.text
                pos = t.end
            text += self.tok.decode(self.traj.ids[pos:])
            if prompt.startswith(text):
                return self._enc(prompt[len(text) :])
            self._restart()
        self.traj = Trajectory(self._enc(prompt, bos=True))
        self.turns = []
        return []

    def _restart(self) -> None:
        self.stats["restarts"] += 1
        self.stats["dropped_model_tokens"] += sum(self.traj.mask)

    # -- recording ----------------------------------------------------------------------------
    def record(self, obs_ids: list[int], g, text: str) -> None:
        """Observation ids appended, then the generation `g` (engine Generation) returned as `text`."""
        if obs_ids:
            self.traj.add_observation(obs_ids)
        start = len(self.traj.ids)
        self.traj.add_model(g)
        self.turns.append(Turn(start, len(self.traj.ids), text))


def _interleave(chunks: list[str], contents: list[str]) -> list[str]:
    """contents[0], chunks[0], contents[1], chunks[1], ... (assistant text the server did not make
    is context like any other text)."""
    out = []
    for i, c in enumerate(chunks):
        if i < len(contents):
            out.append(contents[i])
        out.append(c)
    return out


def rollout_of(task, sp, index: int, rec: TrajectoryRecorder, result, tok, worker_id: str, episode: dict):
    """The Rollout of an episode a harness played through the endpoint: the recorded trajectory
    (prompt ids, model and observation ids, mask, versions, sampling rows) and the EpisodeResult
    of its hidden tests (`episode`: extra keys of Rollout.episode). ValueError: no model turn."""
    traj = rec.traj
    if traj is None or not any(traj.mask):
        raise ValueError(f"episode {rec.episode_id} ended without a model turn")
    return build_rollout(
        task,
        index,
        sp.n,
        worker_id,
        traj.prompt_ids,
        traj,
        tok.decode(traj.ids),
        result.wall_s,
        loss_mask=traj.mask,
        result=result,
        turns=len(rec.turns),
        episode={**episode, "trajectory": dict(rec.stats), "turn_log": [{"finish": ""} for _ in rec.turns]},
    )


def count_episode(
    stats: dict, ended: list, rec: TrajectoryRecorder, result, wall_s: float, harness_exit: str
) -> None:
    """The worker's books of one harness-played episode: its counters (`stats`, the worker's
    metrics) and a record in `ended` (bench.agentic reads them; capped at 4096)."""
    traj = rec.traj
    stats["episodes"] += 1
    stats["turns"] += len(rec.turns)
    stats["tool_calls"] += result.tool_calls
    stats["tool_wall_s"] += result.tool_wall_s
    stats["wall_s"] += wall_s
    for k in ("divergent_turns", "restarts", "retried_turns", "dropped_model_tokens"):
        stats[k] = stats.get(k, 0) + rec.stats[k]
    if len(ended) < 4096:
        ended.append(
            {
                "ended_at": time.time(),
                "turns": len(rec.turns),
                "tool_calls": result.tool_calls,
                "tokens": len(traj.ids),
                "model_tokens": sum(traj.mask),
                "wall_s": result.wall_s,
                "tool_wall_s": result.tool_wall_s,
                "termination": result.termination,
                "reward": result.reward,
                "resolved": result.resolved,
                "suite_wait_s": 0.0,
                "suite_runs": 0,
                "harness_exit": harness_exit,
            }
        )
