"""The multi-turn episode protocol (next to the single-turn `Env` of envs/base.py).

    task  = EpisodeTask(...)                       # what to solve: files, tests, limits-independent
    ep    = Episode(task, EpisodeLimits(), LocalBackend())
    msgs  = ep.reset()                              # [system, user] messages; creates the workspace
    while True:
        r = ep.step(model_text, n_tokens=k)         # StepResult(observation, done, info)
        if r.done: break
    res   = ep.score()                              # EpisodeResult: reward, tests, termination, counts
    ep.close()                                      # deletes the workspace

Synchronous and picklable (only paths, numbers and dataclasses inside): it runs off the decode
loop in envs/episode_pool.py. Observations are text for the worker to append as tokens after the
ids it generated; the episode never re-renders earlier turns.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from .actions import (
    command_observation,
    failures_summary,
    format_error_observation,
    is_run_tests,
    is_submit,
    parse_action,
)
from .sandbox import BashLimits

TERMINATIONS = ("submitted", "max_turns", "context_limit", "timeout", "format", "sandbox_error")
SPLITS = ("train", "eval")
PROMPT_STYLES = ("full", "toy")
TEST_OUTPUTS = ("full", "failures")


@dataclass(frozen=True)
class EpisodeTask:
    """One repository-level task. `files` (plus a copy of `base_dir`, when set) is the workspace;
    `hidden_tests` are written over it before scoring, so editing the tests never helps; reward
    is the fraction of `fail_to_pass` + `pass_to_pass` that pass then."""

    task_id: str
    family: str  # "gen-repo" | "humaneval-fix" | "humaneval-stub" | "package" | ...
    split: str  # "train" | "eval"
    instruction: str  # the problem statement the agent sees
    files: dict[str, str]  # relative path -> text
    hidden_tests: dict[str, str]
    runner: str  # "mini" (envs/workspace_tools.py) | "pytest"
    test_paths: list[str]  # what the runner runs (files or directories)
    fail_to_pass: list[str]  # test ids "path::name"
    pass_to_pass: list[str]
    base_dir: str | None = None  # a directory copied first (a task set's repository snapshot)
    meta: dict = field(default_factory=dict)  # mutation kind, location, before/after (the oracle uses it)
    # the repository's environment (envs/repo_env.py: a task set's envs/<key>): its packages are on
    # the sandbox python's path for the agent's commands and the scoring run
    env_dir: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EpisodeTask:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        } - set(d)
        if missing or set(d) - names:
            raise ValueError(f"bad task record: missing {sorted(missing)}, unknown {sorted(set(d) - names)}")
        t = cls(**d)
        if (
            t.split not in SPLITS
            or t.runner not in ("mini", "pytest")
            or not (t.fail_to_pass or t.pass_to_pass)
        ):
            raise ValueError(
                f"bad task record {t.task_id!r}: split {t.split!r}, runner {t.runner!r}, "
                f"{len(t.fail_to_pass)} fail-to-pass, {len(t.pass_to_pass)} pass-to-pass tests"
            )
        return t


@dataclass
class EpisodeLimits:
    max_turns: int = 15
    episode_wall_s: float = 300.0  # from reset(), model time included
    max_context_tokens: int = 16384  # prompt + every action + every observation
    max_turn_tokens: int = 1024  # one action (the worker should generate at most this)
    max_format_errors: int = 3  # consecutive turns without exactly one action
    command: BashLimits = field(default_factory=BashLimits)  # per command (= per turn: one command a turn)
    workspace_mb: int = 64
    workspace_files: int = 20_000
    obs_head_lines: int = 40
    obs_tail_lines: int = 40
    obs_line_chars: int = 300
    score_wall_s: float = 120.0
    # "full": SYSTEM_PROMPT (for real models); "toy": TOY_SYSTEM_PROMPT, a few lines naming the
    # helpers, for the char-level toy policy whose every prompt character costs a forward/backward
    prompt_style: str = "full"
    # "full": a command's whole (cut) output; "failures": `run_tests` observations keep only the
    # failing tests' lines and the summary (envs/actions.py: failures_summary), for the toy policy
    test_output: str = "full"

    def __post_init__(self):
        if self.prompt_style not in PROMPT_STYLES or self.test_output not in TEST_OUTPUTS:
            raise ValueError(
                f"prompt_style must be one of {PROMPT_STYLES}, test_output one of {TEST_OUTPUTS}: "
                f"got {self.prompt_style!r}, {self.test_output!r}"
            )
        if (
            min(
                self.max_turns,
                self.max_context_tokens,
                self.max_turn_tokens,
                self.max_format_errors,
                self.workspace_mb,
                self.workspace_files,
            )
            < 1
            or self.episode_wall_s <= 0
        ):
            raise ValueError(f"episode limits must be positive: {self}")
        if isinstance(self.command, dict):
            self.command = BashLimits(**self.command)


@dataclass
class StepResult:
    observation: str
    done: bool
    info: dict


@dataclass
class EpisodeResult:
    task_id: str
    reward: float  # fraction of fail-to-pass + pass-to-pass tests passing
    resolved: bool  # all of them pass
    termination: str  # one of TERMINATIONS
    turns: int
    tool_calls: int
    format_errors: int
    tokens: int
    wall_s: float
    tool_wall_s: float
    tests: dict[str, bool]  # test id -> passed, over fail-to-pass + pass-to-pass
    detail: str = ""
    # agent files kept out of the scoring copy: tests and test infrastructure ("path (kind)", at most
    # scoring_copy.MAX_LISTED named; n_dropped counts them all; envs/scoring_copy.py)
    dropped: list[str] = field(default_factory=list)
    n_dropped: int = 0
    tampered: str = ""  # why the scoring run's verdict was judged forged (every test failed)
    # an infrastructure failure ("workspace", "sandbox", "scoring_copy"): no verdict on the policy;
    # the scorer marks it (Scored.infra) and the trainer leaves it out of its group (weight 0)
    infra_error: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


UNRUNNABLE_EXIT = 126  # the shell's "cannot execute"


def unrunnable(command: str) -> str:
    """Why no shell can run `command` ('' if one can): a NUL byte ends a C string, and a lone
    surrogate has no bytes."""
    if "\x00" in command:
        return f"it contains a NUL byte (character {command.index(chr(0))})"
    try:
        command.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"it is not valid UTF-8 (a lone surrogate at character {e.start})"
    return ""


def approx_tokens(text: str) -> int:
    """Token count when the worker passes no tokenizer-exact figure: ~4 bytes a token."""
    return (len(text.encode("utf-8", "surrogatepass")) + 3) // 4


SYSTEM_PROMPT = """You are a software engineer working in a repository through a bash shell.
Every reply: a short thought, then exactly ONE fenced ```bash block with the command to run.
It runs in the repository root; you see its exit code and output (long output is cut).
Helpers:
  view FILE [START [END]]        show a file (or a line range) with line numbers
  replace FILE <<'EOF'           replace one exact block of text in FILE:
  <<<<<<< SEARCH
  (lines to find, exactly as in the file)
  =======
  (new lines)
  >>>>>>> REPLACE
  EOF
  rewrite FILE <<'EOF'           replace the function (or method) of the same name in FILE:
  def name(...):
      (the whole new function)
  EOF
  run_tests [ARGS]               run the tests
  submit                         end the episode (alone in its block)
There is no network. Do not edit the tests."""

# The toy policy's prompt (EpisodeLimits.prompt_style = "toy"): the helpers and nothing else.
TOY_SYSTEM_PROMPT = """Fix the bug. Each reply: one ```bash block.
run_tests             run the tests
view FILE [START END] show lines
rewrite FILE <<'EOF'  replace the function of the same name
def ...
EOF
submit                end"""


def initial_messages(task: EpisodeTask, limits: EpisodeLimits) -> list[dict]:
    """[system, user]: the full prompt and the task's instruction, or for the toy style the toy
    prompt and a one-line brief built from the task (its first failing tests and source files):
    the toy policy's warm start pays a forward and backward for every prompt character."""
    if limits.prompt_style != "toy":
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.instruction}]
    f2p = task.fail_to_pass or task.pass_to_pass
    more = f" and {len(f2p) - 2} more" if len(f2p) > 2 else ""
    src = sorted(p for p in task.files if not os.path.basename(p).startswith("test"))
    brief = f"Failing: {', '.join(f2p[:2])}{more}.\nFiles: {', '.join(src)}."
    return [{"role": "system", "content": TOY_SYSTEM_PROMPT}, {"role": "user", "content": brief}]


class Episode:
    """One episode of a task in a workspace (see the module docstring)."""

    def __init__(
        self,
        task: EpisodeTask,
        limits: EpisodeLimits | None = None,
        backend=None,
        token_counter=approx_tokens,
    ):
        from .workspace import LocalBackend

        self.task, self.limits = task, limits or EpisodeLimits()
        self.backend = backend or LocalBackend()
        self.count_tokens = token_counter
        self.workspace = None
        self.turns = self.tool_calls = self.format_errors = self._format_run = self.tokens = 0
        self.action_tokens = 0  # the policy's own tokens (what a cost in tokens counts), of `tokens`
        self.tool_wall_s, self.t0, self.done, self.termination, self.detail = 0.0, 0.0, False, "", ""
        self.infra = ""  # set when the sandbox, not the policy, ended the episode

    # -- protocol ---------------------------------------------------------------------------------
    def reset(self) -> list[dict]:
        if self.workspace is not None:
            raise RuntimeError("reset() twice: make a new Episode per rollout")
        self.t0 = time.monotonic()
        self.workspace = self.backend.create(self.task, self.limits)
        msgs = initial_messages(self.task, self.limits)
        self.tokens = sum(self.count_tokens(m["content"]) for m in msgs)
        if self.workspace.error:
            self.infra = "workspace"
            self.end("sandbox_error", self.workspace.error)
        return msgs

    def step(self, action: str, n_tokens: int | None = None) -> StepResult:
        if self.workspace is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            raise RuntimeError(f"step() after the episode ended ({self.termination})")
        self.turns += 1
        n = self.count_tokens(action) if n_tokens is None else n_tokens
        self.tokens += n
        self.action_tokens += n
        info = {"turn": self.turns, "action_tokens": n}
        command, why = parse_action(action)
        if command is None or n > self.limits.max_turn_tokens:
            why = why if command is None else f"the turn is longer than {self.limits.max_turn_tokens} tokens"
            self.format_errors += 1
            self._format_run += 1
            obs = format_error_observation(why)
            info.update(format_error=why)
            if self._format_run >= self.limits.max_format_errors:
                self.end("format", f"{self._format_run} turns in a row without one action")
        else:
            self._format_run = 0
            if is_submit(command):
                obs = "Submitted."
                self.end("submitted")
            else:
                obs = self._run(command, info)
        self.tokens += self.count_tokens(obs)
        if not self.done:
            if self.tokens > self.limits.max_context_tokens:
                self.end("context_limit", f"{self.tokens} tokens > {self.limits.max_context_tokens}")
            elif self.turns >= self.limits.max_turns:
                self.end("max_turns")
            elif time.monotonic() - self.t0 > self.limits.episode_wall_s:
                self.end("timeout", f"episode over {self.limits.episode_wall_s}s")
        info.update(tokens=self.tokens, termination=self.termination or None)
        return StepResult(obs, self.done, info)

    def score(self) -> EpisodeResult:
        if self.workspace is None:
            raise RuntimeError("score() before reset()")
        if not self.done:
            self.end("timeout", "scored before the episode ended")
        ids = list(dict.fromkeys(self.task.fail_to_pass + self.task.pass_to_pass))
        info = None
        if self.termination == "sandbox_error":
            tests, detail = {t: False for t in ids}, self.detail  # the workspace is not trusted
        else:
            status, detail = self.workspace.run_hidden_tests(self.task, self.limits)
            tests = {t: status.get(t) == "PASS" for t in ids}
            detail = "; ".join(x for x in (self.detail, detail) if x)
            info = getattr(self.workspace, "score_info", None)
        n_pass = sum(tests.values())
        res = EpisodeResult(
            self.task.task_id,
            n_pass / len(ids) if ids else 0.0,
            bool(ids) and n_pass == len(ids),
            self.termination,
            self.turns,
            self.tool_calls,
            self.format_errors,
            self.tokens,
            time.monotonic() - self.t0,
            self.tool_wall_s,
            tests,
            detail,
            infra_error=self.infra,
        )
        if info is not None:
            res.dropped, res.n_dropped, res.tampered = list(info.dropped), info.n_dropped, info.tampered
            res.infra_error = res.infra_error or info.infra
        if res.tampered:
            res.detail = "; ".join(x for x in (res.detail, f"tampered: {res.tampered}") if x)
        return res

    def close(self) -> None:
        if self.workspace is not None:
            self.workspace.close()

    def end(self, termination: str, detail: str = "") -> None:
        """End the episode now: its own limits, or its player's (the context is full)."""
        assert termination in TERMINATIONS, termination
        self.done, self.termination, self.detail = True, termination, detail

    # -- internals --------------------------------------------------------------------------------
    def _run(self, command: str, info: dict) -> str:
        L = self.limits
        why = unrunnable(command)
        if why:  # the policy's own output: it sees why, the turn counts, nothing is run
            self.tool_calls += 1
            info.update(exit_code=UNRUNNABLE_EXIT, command_reason=why)
            return command_observation(UNRUNNABLE_EXIT, "", f"command not run: {why}")
        res = self.workspace.run(command, L.command)
        self.tool_calls += 1
        self.tool_wall_s += res.wall_s
        info.update(exit_code=res.returncode, command_reason=res.reason, command_wall_s=round(res.wall_s, 4))
        if res.reason.startswith("sandbox error"):
            self.infra = "sandbox"
            self.end("sandbox_error", res.reason)
        warning = (
            ""
            if res.reason == "ok" or res.reason.startswith("exit code")
            else f"command stopped: {res.reason}"
        )
        over = self.workspace.over_limit(L.workspace_mb, L.workspace_files)
        if over and not self.done:
            self.end("sandbox_error", over)
            warning = (warning + "; " if warning else "") + over
        out = res.stdout.decode("utf-8", "replace")
        if L.test_output == "failures" and is_run_tests(command):
            out = failures_summary(out)
        return command_observation(
            res.returncode, out, warning, L.obs_head_lines, L.obs_tail_lines, L.obs_line_chars
        )
