"""Scripted oracle episodes for bug-fix tasks: run the tests, read the failing code, replace the
mutated lines with the original ones, run the tests again, submit. They are real episodes (every
command runs in the sandbox) and come back as text turns: (action, observation) pairs that can
warm-start a policy on exactly the action format it will be trained on."""
from __future__ import annotations

from .episode import Episode, EpisodeLimits, EpisodeResult, EpisodeTask


def fix_block(task: EpisodeTask) -> tuple[str, str, str]:
    """(path, SEARCH text, REPLACE text) undoing the task's mutation, with just enough context
    lines around it for the SEARCH text to occur once in the file."""
    m = task.meta
    if not {"path", "line", "before", "after"} <= set(m):
        raise ValueError(f"task {task.task_id} has no mutation record (meta {sorted(m)})")
    lines = task.files[m["path"]].splitlines(keepends=True)
    a = m["line"] - 1
    n_after = len(m["after"].splitlines(keepends=True))
    text = "".join(lines)
    for ctx in range(0, len(lines) + 1):
        pre, post = lines[max(a - ctx, 0):a], lines[a + n_after:a + n_after + ctx]
        search = "".join(pre) + m["after"] + "".join(post)
        if search.strip() and text.count(search) == 1:
            return m["path"], search, "".join(pre) + m["before"] + "".join(post)
    raise ValueError(f"task {task.task_id}: no unique context for the fix")


def oracle_actions(task: EpisodeTask) -> list[str]:
    path, search, replace = fix_block(task)
    line = task.meta["line"]
    nl = lambda s: s if s.endswith("\n") else s + "\n"          # noqa: E731
    return [
        "Let me run the tests to see what fails.\n```bash\nrun_tests\n```",
        f"The failures point at {path}. Let me read the code around line {line}.\n"
        f"```bash\nview {path} {max(1, line - 6)} {line + 6}\n```",
        f"Line {line} of {path} is wrong. I'll fix it.\n```bash\nreplace {path} <<'EOF'\n"
        f"<<<<<<< SEARCH\n{nl(search)}=======\n{nl(replace)}>>>>>>> REPLACE\nEOF\n```",
        "Now the tests again.\n```bash\nrun_tests\n```",
        "All tests pass.\n```bash\nsubmit\n```",
    ]


def run_oracle(task: EpisodeTask, limits: EpisodeLimits | None = None, backend=None
               ) -> tuple[list[dict], list[dict], EpisodeResult]:
    """Play the oracle in a real episode: (initial messages, [{action, observation}], result)."""
    ep = Episode(task, limits, backend)
    try:
        msgs = ep.reset()
        turns = []
        for action in oracle_actions(task):
            r = ep.step(action)
            turns.append({"action": action, "observation": r.observation})
            if r.done:
                break
        return msgs, turns, ep.score()
    finally:
        ep.close()
