"""Multi-turn episodes: the action format, observations, limits and termination reasons, the
bash sandbox against hostile commands, scoring against hidden tests, the pool, the oracle."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import time
from dataclasses import replace

import pytest

from envs.actions import cut_lines, failures_summary, is_run_tests, parse_action
from envs.episode import TOY_SYSTEM_PROMPT, Episode, EpisodeLimits, EpisodeTask
from envs.episode_pool import EpisodePool
from envs.sandbox import BashLimits, isolation
from envs.workspace import LocalBackend, default_root

TESTS = (
    "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_zero():\n    assert add(0, 0) == 0\n"
)
FIX = (
    "```bash\nreplace calc.py <<'EOF'\n<<<<<<< SEARCH\n    return a - b\n=======\n    return a + b\n"
    ">>>>>>> REPLACE\nEOF\n```"
)
FAST = EpisodeLimits(command=BashLimits(wall_s=2.0, cpu_s=2), max_turns=8, score_wall_s=20.0)


def bug_task(hidden_extra: str = "") -> EpisodeTask:
    return EpisodeTask(
        "t-add",
        "test",
        "train",
        "Fix calc.py.",
        {"calc.py": "def add(a, b):\n    return a - b\n", "test_calc.py": TESTS},
        {"test_calc.py": TESTS + hidden_extra},
        "mini",
        ["test_calc.py"],
        ["test_calc.py::test_add"],
        ["test_calc.py::test_zero"],
    )


def bash(cmd: str) -> str:
    return f"Running it.\n```bash\n{cmd}\n```"


@pytest.fixture
def episode():
    eps = []

    def make(task=None, limits=FAST):
        ep = Episode(task or bug_task(), limits)
        ep.reset()
        eps.append(ep)
        return ep

    yield make
    for ep in eps:
        ep.close()


# -- action format and observations -------------------------------------------------------------


def test_parse_action():
    assert parse_action("think\n```bash\nls -la\n```\n") == ("ls -la", "")
    assert parse_action("no block")[0] is None and "no ```bash" in parse_action("no block")[1]
    assert "2 ```bash" in parse_action("```bash\nls\n```\n```bash\npwd\n```")[1]
    assert parse_action("```bash\n\n```")[0] is None
    assert parse_action("```python\nprint(1)\n```")[0] is None  # only bash blocks are actions
    assert parse_action("```bash\nls")[0] is None  # unclosed (a truncated turn)


def test_cut_lines():
    text = "\n".join(f"line {i}" for i in range(100))
    out = cut_lines(text, 3, 2, 300)
    assert out.splitlines() == [
        "line 0",
        "line 1",
        "line 2",
        "[... 95 lines omitted ...]",
        "line 98",
        "line 99",
    ]
    assert cut_lines("x" * 1000, 3, 3, 10) == "x" * 10 + " [... 990 chars]"
    assert cut_lines("a\nb", 3, 3, 10) == "a\nb"


# -- a whole episode ----------------------------------------------------------------------------


def test_episode_fix_and_submit(episode):
    ep = episode()
    r = ep.step(bash("run_tests"))
    assert "<returncode>1</returncode>" in r.observation and "FAILED test_calc.py::test_add" in r.observation
    r = ep.step("I think the bug is in add.")  # no action: counted, no crash
    assert "<format_error>" in r.observation and not r.done and r.info["format_error"]
    assert "return a - b" in ep.step(bash("view calc.py")).observation
    assert "replaced 1 line(s)" in ep.step(FIX).observation
    assert "2 passed, 0 failed" in ep.step(bash("run_tests")).observation
    r = ep.step(bash("submit"))
    assert r.done and r.info["termination"] == "submitted"
    res = ep.score()
    assert res.reward == 1.0 and res.resolved and res.termination == "submitted"
    assert (res.turns, res.tool_calls, res.format_errors) == (6, 4, 1) and res.tool_wall_s > 0
    with pytest.raises(RuntimeError):
        ep.step(bash("ls"))


def test_unfixed_and_test_tampering_score_zero(episode):
    ep = episode(bug_task(hidden_extra="\n\ndef test_more():\n    assert add(1, 1) == 2\n"))
    # rewriting the visible tests makes them pass here, but scoring restores the hidden ones
    r = ep.step(
        bash(
            "printf 'def test_add():\\n    pass\\ndef test_zero():\\n    pass\\n' > test_calc.py && run_tests"
        )
    )
    assert "2 passed" in r.observation
    ep.step(bash("submit"))
    res = ep.score()
    assert (
        res.reward == 0.5
        and not res.resolved
        and res.tests == {"test_calc.py::test_add": False, "test_calc.py::test_zero": True}
    )


def test_submit_inside_a_longer_command_is_not_a_submit(episode):
    ep = episode()
    r = ep.step(bash("ls && submit"))
    assert not r.done and "must be the only command" in r.observation


def test_max_turns(episode):
    ep = episode(limits=EpisodeLimits(max_turns=2, command=BashLimits(wall_s=2.0)))
    assert not ep.step(bash("true")).done
    r = ep.step(bash("true"))
    assert r.done and ep.score().termination == "max_turns"


def test_format_termination(episode):
    ep = episode(limits=EpisodeLimits(max_format_errors=2))
    assert not ep.step("no action").done
    assert ep.step("```bash\nls\n```\n```bash\nls\n```").done
    res = ep.score()
    assert res.termination == "format" and res.format_errors == 2 and res.reward == 0.5


def test_turn_token_and_context_limits(episode):
    ep = episode(limits=EpisodeLimits(max_turn_tokens=10, command=BashLimits(wall_s=2.0)))
    r = ep.step(bash("ls"), n_tokens=11)  # the worker reports a turn over its budget
    assert "longer than 10 tokens" in r.observation and r.info["format_error"]
    ep = episode(limits=EpisodeLimits(command=BashLimits(wall_s=2.0)))
    ep.limits.max_context_tokens = ep.tokens + 60  # the prompt plus a little
    r = ep.step(bash("seq 1 2000"))
    assert r.done and r.info["termination"] == "context_limit"
    assert "lines omitted" in r.observation  # the output was cut to head + tail


def test_episode_timeout(episode):
    ep = episode(limits=EpisodeLimits(episode_wall_s=0.5, command=BashLimits(wall_s=2.0)))
    time.sleep(0.6)  # the model took its time
    r = ep.step(bash("true"))
    assert r.done and r.info["termination"] == "timeout"


def test_episode_pickles_mid_episode(episode):
    ep = episode()
    ep.step(FIX)
    copy = pickle.loads(pickle.dumps(ep))  # e.g. handed to a process pool
    assert "2 passed" in copy.step(bash("run_tests")).observation
    assert copy.step(bash("submit")).done and copy.score().reward == 1.0


# -- hostile commands ---------------------------------------------------------------------------


def _uid_processes(uid: int, wait_s: float = 5.0) -> int:
    """Live (not zombie) processes of `uid`, once they had `wait_s` to die (SIGKILL is asynchronous)."""
    deadline = time.monotonic() + wait_s
    while True:
        n = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    with open(f"/proc/{pid}/stat") as f:
                        n += f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except (OSError, IndexError):
                pass
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


def test_sleep_forever_is_killed_and_the_episode_goes_on(episode):
    ep = episode()
    t0 = time.monotonic()
    r = ep.step(bash("sleep 1000 & sleep 1000"))
    assert time.monotonic() - t0 < 15
    assert "wall timeout after 2.0s" in r.observation and not r.done
    assert "ok" in ep.step(bash("echo ok")).observation
    if ep.workspace.uid is not None and isolation()[2]:
        assert _uid_processes(ep.workspace.uid) == 0  # the background sleep died too


def test_fork_bomb_is_contained(episode):
    ep = episode()
    r = ep.step(bash("bomb() { bomb | bomb & }; bomb; sleep 5"))
    assert not r.done and ("wall timeout" in r.observation or "<returncode>" in r.observation)
    assert "still here" in ep.step(bash("echo still here")).observation
    if ep.workspace.uid is not None and isolation()[2]:
        assert _uid_processes(ep.workspace.uid) == 0


def test_endless_output_is_capped(episode):
    ep = episode(limits=EpisodeLimits(command=BashLimits(wall_s=5.0, file_mb=1)))
    r = ep.step(bash("yes"))
    assert "output limit (1 MB)" in r.observation and len(r.observation) < 20_000 and not r.done
    r = ep.step(bash("yes | head -c 100000 > out.txt; wc -c out.txt"))
    assert "100000 out.txt" in r.observation


def test_writing_outside_the_workspace_is_refused(episode):
    ep = episode()
    marker = f"/tmp/asyncrl-escape-{os.getpid()}"
    r = ep.step(
        bash(
            f"echo x > ../escape; echo x > /etc/escape; echo x > {marker}; ls {marker}; "
            f"touch {default_root()}/escape"
        )
    )
    assert r.observation.count("Permission denied") >= 2
    for p in (
        os.path.join(ep.workspace.root, "escape"),
        "/etc/escape",
        marker,
        os.path.join(default_root(), "escape"),
    ):
        assert not os.path.exists(p), p  # /tmp inside the sandbox is private


def test_workspace_size_limit(episode):
    ep = episode(limits=EpisodeLimits(workspace_mb=2, command=BashLimits(wall_s=5.0, file_mb=16)))
    r = ep.step(bash("head -c 3000000 /dev/zero > big.bin"))
    assert r.done and r.info["termination"] == "sandbox_error" and "over 2 MB" in r.observation
    res = ep.score()
    assert res.reward == 0.0 and "over 2 MB" in res.detail


def test_no_network():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    ep = Episode(bug_task(), FAST)
    try:
        ep.reset()
        r = ep.step(
            bash(
                f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1); "
                f"print('connected')\"; (exec 3<>/dev/tcp/127.0.0.1/{port}) && echo bash-connected"
            )
        )
        assert "connected" not in r.observation.replace("create_connection", "")
        with pytest.raises(socket.timeout):
            srv.accept()  # nothing reached the listener
    finally:
        srv.close()
        ep.close()


def test_hidden_tests_are_out_of_reach(episode):
    secret = "SECRET_HIDDEN_MARKER_7f3a"
    ep = episode(bug_task(hidden_extra=f"\n\ndef test_{secret}():\n    assert add(1, 1) == 2\n"))
    r = ep.step(
        bash(f"grep -rl {secret} .. {default_root()} /tmp 2>&1 | head; ls ..; cat ../score/test_calc.py")
    )
    assert secret not in r.observation and "Permission denied" in r.observation
    ep.step(FIX)
    ep.step(bash("submit"))
    assert ep.score().reward == 1.0  # they were used for scoring


def test_scoring_never_writes_through_a_planted_symlink(tmp_path):
    """The hidden tests are written as root into the scoring copy: a `tests` directory the agent
    replaced by a link to a host directory must not redirect them there."""
    target = tmp_path / "host-dir"
    target.mkdir()
    task = EpisodeTask(
        "t-link",
        "test",
        "train",
        "x",
        {"calc.py": "def add(a, b):\n    return a + b\n", "tests/test_calc.py": TESTS},
        {"tests/test_calc.py": TESTS},
        "mini",
        ["tests/test_calc.py"],
        [],
        ["tests/test_calc.py::test_add"],
    )
    ep = Episode(task, FAST)
    try:
        ep.reset()
        ep.step(bash(f"rm -rf tests && ln -s {target} tests && ln -s {target}/x.py calc2.py"))
        ep.step(bash("submit"))
        res = ep.score()
    finally:
        ep.close()
    assert list(target.iterdir()) == [] and res.reward == 1.0  # tests restored in the copy, host untouched


def test_other_episodes_are_unaffected():
    """A hostile episode (fork bomb, endless sleep) next to a normal one in the pool."""
    pool = EpisodePool(4)
    script = {
        "good": [bash("run_tests"), FIX, bash("run_tests"), bash("submit")],
        "bad": [bash("bomb() { bomb | bomb & }; bomb; sleep 100"), bash("sleep 100"), bash("submit")],
    }

    def policy(name):
        async def act(msgs, turns):
            return script[name][len(turns)]

        return act

    async def main():
        eps = {n: Episode(bug_task(), FAST) for n in script}
        return await asyncio.gather(*(pool.run(eps[n], policy(n)) for n in script))

    try:
        (good_turns, good), (bad_turns, bad) = asyncio.run(main())
    finally:
        pool.shutdown()
    assert good.reward == 1.0 and good.termination == "submitted"
    assert bad.termination == "submitted" and bad.reward == 0.5
    assert "wall timeout" in bad_turns[1][1].observation


def test_pool_runs_episodes_concurrently():
    pool = EpisodePool(4)

    async def act(msgs, turns):
        return bash("sleep 1.5") if not turns else bash("submit")

    async def main():
        t0 = time.monotonic()
        await asyncio.gather(*(pool.run(Episode(bug_task(), FAST), act) for _ in range(4)))
        return time.monotonic() - t0

    try:
        took = asyncio.run(main())
    finally:
        pool.shutdown()
    assert took < 4 * 1.5  # the four sleeps overlapped


def test_pool_refuses_interleaved_calls():
    pool = EpisodePool(2)
    ep = Episode(bug_task(), FAST)

    async def main():
        await pool.reset(ep)
        a = asyncio.ensure_future(pool.step(ep, bash("sleep 0.5")))
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="in flight"):
            await pool.step(ep, bash("ls"))
        await a

    try:
        asyncio.run(main())
    finally:
        ep.close()
        pool.shutdown()


def test_workspace_setup_failure_is_a_sandbox_error(tmp_path):
    bad = EpisodeTask(
        "t-bad", "test", "train", "x", {"../outside.py": "x = 1\n"}, {}, "mini", ["t.py"], ["t.py::a"], []
    )
    ep = Episode(bad, FAST)
    try:
        ep.reset()
        assert ep.done
        res = ep.score()
        assert (
            res.termination == "sandbox_error" and "leaves the workspace" in res.detail and res.reward == 0.0
        )
    finally:
        ep.close()
    assert not (tmp_path.parent / "outside.py").exists()


def test_backend_is_picklable():
    b = pickle.loads(pickle.dumps(LocalBackend()))
    assert b.root_dir == default_root()


# -- the rewrite helper -------------------------------------------------------------------------

MODULE = (
    '"""A module."""\nimport functools\n\n\ndef add(a, b):\n    return a - b\n\n\n'
    "class Box:\n    @functools.cache\n    def size(self):\n        return 0\n\n\n"
    'def other():\n    return "x"\n'
)


def rewrite(path: str, body: str) -> str:
    return bash(f"rewrite {path} <<'EOF'\n{body}EOF")


def file_text(ep, rel: str) -> str:
    with open(os.path.join(ep.workspace.repo, rel)) as f:
        return f.read()


def module_task() -> EpisodeTask:
    t = bug_task()
    return EpisodeTask(
        t.task_id,
        t.family,
        t.split,
        t.instruction,
        {**t.files, "calc.py": MODULE},
        t.hidden_tests,
        t.runner,
        t.test_paths,
        t.fail_to_pass,
        t.pass_to_pass,
    )


def test_rewrite_replaces_the_function_of_the_same_name(episode):
    ep = episode(module_task())
    r = ep.step(rewrite("calc.py", "def add(a, b):\n    s = a + b\n    return s\n"))
    assert "<returncode>0</returncode>" in r.observation and "rewrote add" in r.observation
    assert file_text(ep, "calc.py") == MODULE.replace("    return a - b\n", "    s = a + b\n    return s\n")
    assert "2 passed, 0 failed" in ep.step(bash("run_tests")).observation
    # a method: indented to its class, its decorator replaced by the new one's (none here)
    r = ep.step(rewrite("calc.py", "def size(self):\n    return 1\n"))
    assert "rewrote size" in r.observation
    assert "class Box:\n    def size(self):\n        return 1\n\n\ndef other" in file_text(ep, "calc.py")
    ep.step(bash("submit"))
    assert ep.score().reward == 1.0


@pytest.mark.parametrize(
    "path, body, why",
    [
        ("calc.py", "def add(a, b:\n    return a + b\n", "does not parse"),
        ("calc.py", "def nope(a, b):\n    return a + b\n", "defines nope 0 times"),
        ("calc.py", "def add(a, b):\n    return a + b\n\n\ndef other():\n    pass\n", "exactly one function"),
        ("calc.py", "x = 1\n", "exactly one function"),
        ("calc.py", "", "exactly one function"),
        ("calc.py", "def add(a, b):\n    return a + b\n  x = 1\n", "does not parse"),
        ("missing.py", "def add(a, b):\n    return a + b\n", "is not a file"),
        (".", "def add(a, b):\n    return a + b\n", "outside the repository"),
        ("../tools/view", "def add(a, b):\n    return a + b\n", "outside the repository"),
        ("/etc/passwd", "def add(a, b):\n    return a + b\n", "outside the repository"),
        ("link.py", "def add(a, b):\n    return a + b\n", "outside the repository"),  # -> /etc/hostname
        ("dup.py", "def f():\n    return 2\n", "defines f 2 times"),
        ("broken.py", "def f():\n    return 2\n", "broken.py does not parse"),
    ],
)
def test_rewrite_bad_input_is_a_clear_error_and_changes_nothing(episode, path, body, why):
    ep = episode(module_task())
    ep.step(
        bash(
            "ln -s /etc/hostname link.py; "
            "printf 'def f():\\n    return 1\\n\\n\\ndef f():\\n    return 1\\n' "
            "> dup.py; printf 'def f(:\\n' > broken.py"
        )
    )
    before = {p: file_text(ep, p) for p in ("calc.py", "dup.py", "broken.py")}
    r = ep.step(rewrite(path, body))
    assert "<returncode>1</returncode>" in r.observation and why in r.observation, r.observation
    assert {p: file_text(ep, p) for p in before} == before and not r.done
    assert "1 passed, 1 failed" in ep.step(bash("run_tests")).observation


def test_rewrite_refuses_endless_input(episode):
    ep = episode(module_task(), EpisodeLimits(command=BashLimits(wall_s=5.0, cpu_s=5), score_wall_s=20.0))
    r = ep.step(bash("yes | rewrite calc.py"))
    assert "longer than 200000 characters" in r.observation and file_text(ep, "calc.py") == MODULE


# -- toy prompt and observations ----------------------------------------------------------------


def test_test_failures_keeps_failing_names_and_summary():
    out = (
        'FAILED t.py::test_a\n  File "x.py", line 3, in f\nAssertionError: 1 != 2\n'
        "ERROR collecting t2.py\nTraceback ...\n\n3 passed, 2 failed\n"
    )
    assert failures_summary(out) == "FAILED t.py::test_a\nERROR collecting t2.py\n3 passed, 2 failed"
    assert failures_summary("2 passed, 0 failed\n") == "2 passed, 0 failed"
    assert is_run_tests("run_tests") and is_run_tests("run_tests tests/test_a.py")
    assert (
        not is_run_tests("run_tests | cat")
        and not is_run_tests("cat x; run_tests")
        and not is_run_tests("run_testsx")
    )


def test_toy_style_prompt_and_run_tests_observation(episode):
    full, toy = episode(), episode(limits=replace(FAST, prompt_style="toy", test_output="failures"))
    obs_full, obs_toy = (ep.step(bash("run_tests")).observation for ep in (full, toy))
    assert "AssertionError" in obs_full and "AssertionError" not in obs_toy
    assert "FAILED test_calc.py::test_add" in obs_toy and "1 passed, 1 failed" in obs_toy
    assert len(obs_toy) < len(obs_full) / 2
    # any other command's output is whole in the toy style too
    assert "AssertionError" in toy.step(bash("run_tests 2>&1 | cat")).observation


def test_toy_system_prompt_is_short_and_names_the_helpers():
    msgs = {}
    for style in ("full", "toy"):
        ep = Episode(bug_task(), replace(FAST, prompt_style=style))
        try:
            msgs[style] = ep.reset()
        finally:
            ep.close()
    toy = msgs["toy"][0]["content"]
    assert toy == TOY_SYSTEM_PROMPT and len(toy) < len(msgs["full"][0]["content"]) / 3
    for helper in ("run_tests", "view", "rewrite", "submit"):
        assert helper in toy and helper in msgs["full"][0]["content"]
    assert msgs["full"][1] == {"role": "user", "content": "Fix calc.py."}  # the task's instruction
    assert msgs["toy"][1] == {"role": "user", "content": "Failing: test_calc.py::test_add.\nFiles: calc.py."}
    with pytest.raises(ValueError, match="prompt_style"):
        EpisodeLimits(prompt_style="tiny")
    with pytest.raises(ValueError, match="test_output"):
        EpisodeLimits(test_output="none")
