"""Scripted oracle episodes for bug-fix tasks: run the tests, read the failing code, replace the
mutated lines with the original ones, run the tests again, submit (style "full"); or, for the toy
policy (style "toy"), run the tests, `rewrite` the function the failing tests name with its
original text, run the tests again, submit. They are real episodes (every
command runs in the sandbox) and come back as text turns: (action, observation) pairs that can
warm-start a policy on exactly the action format it will be trained on."""

from __future__ import annotations

import ast

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
        pre, post = lines[max(a - ctx, 0) : a], lines[a + n_after : a + n_after + ctx]
        search = "".join(pre) + m["after"] + "".join(post)
        if search.strip() and text.count(search) == 1:
            return m["path"], search, "".join(pre) + m["before"] + "".join(post)
    raise ValueError(f"task {task.task_id}: no unique context for the fix")


def function_fix(task: EpisodeTask) -> tuple[str, str, int, int, str, str] | None:
    """(path, function name, first line, last line, SEARCH, REPLACE) that rewrites the whole
    function holding the mutation (its mutated text -> its original text); None when the mutation
    is not inside a function. A toy policy can learn this fix for bugs it never saw: the original
    function is the same whichever of its lines was mutated, while the mutated line only has to be
    copied from the `view` it just read."""
    path, search, replace = fix_block(task)
    mutant = task.files[path]
    original = mutant.replace(search, replace, 1)
    a = task.meta["line"]
    b = a + max(len(task.meta["before"].splitlines()), 1) - 1  # original line numbers
    try:
        fns = [
            n
            for n in ast.walk(ast.parse(original))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and min([n.lineno] + [d.lineno for d in n.decorator_list]) <= a
            and b <= n.end_lineno
        ]
    except SyntaxError:
        return None
    if not fns:
        return None
    f = max(fns, key=lambda n: n.lineno)  # the innermost
    start = min([f.lineno] + [d.lineno for d in f.decorator_list])
    end = f.end_lineno + len(task.meta["after"].splitlines()) - len(task.meta["before"].splitlines())
    mut = "".join(mutant.splitlines(keepends=True)[start - 1 : end])
    orig = "".join(original.splitlines(keepends=True)[start - 1 : f.end_lineno])
    if mutant.count(mut) != 1 or mutant.replace(mut, orig, 1) != original:
        return None
    return path, f.name, start, end, mut, orig


def oracle_actions(task: EpisodeTask) -> list[str]:
    """run_tests -> view the function that holds the bug -> rewrite that function -> run_tests ->
    submit (a bug outside any function: view around its line, replace just the changed lines)."""
    nl = lambda s: s if s.endswith("\n") else s + "\n"  # noqa: E731
    fx = function_fix(task)
    if fx is not None:
        path, name, start, end, search, replace = fx
        read = f"The bug is in {name}. Let me read it.\n```bash\nview {path} {start} {end}\n```"
        fix = f"I'll fix {name}.\n"
    else:
        path, search, replace = fix_block(task)
        line = task.meta["line"]
        read = (
            f"The failures point at {path}. Let me read the code around line {line}.\n"
            f"```bash\nview {path} {max(1, line - 6)} {line + 6}\n```"
        )
        fix = f"Line {line} of {path} is wrong. I'll fix it.\n"
    return [
        "Let me run the tests.\n```bash\nrun_tests\n```",
        read,
        fix + f"```bash\nreplace {path} <<'EOF'\n<<<<<<< SEARCH\n{nl(search)}=======\n"
        f"{nl(replace)}>>>>>>> REPLACE\nEOF\n```",
        "Now the tests again.\n```bash\nrun_tests\n```",
        "All tests pass.\n```bash\nsubmit\n```",
    ]


def toy_oracle_actions(task: EpisodeTask) -> list[str]:
    """run_tests -> rewrite the function that holds the bug -> run_tests -> submit. No `view`: the
    failing tests' names (test_<function>_<k>) say which function, and the fix is that function's
    original text, the same whichever of its lines was mutated, so a policy can learn it by heart.
    A bug outside any function falls back to oracle_actions."""
    fx = function_fix(task)
    if fx is None:
        return oracle_actions(task)
    path, name, _, _, _, original = fx
    body = original if original.endswith("\n") else original + "\n"
    return [
        "Run the tests.\n```bash\nrun_tests\n```",
        f"Fix {name}.\n```bash\nrewrite {path} <<'EOF'\n{body}EOF\n```",
        "Again.\n```bash\nrun_tests\n```",
        "Done.\n```bash\nsubmit\n```",
    ]


def run_oracle(
    task: EpisodeTask, limits: EpisodeLimits | None = None, backend=None
) -> tuple[list[dict], list[dict], EpisodeResult]:
    """Play the oracle in a real episode: (initial messages, [{action, observation}], result);
    the toy oracle when the limits' prompt_style is "toy" (its prompt names `rewrite`)."""
    ep = Episode(task, limits, backend)
    actions = toy_oracle_actions(task) if ep.limits.prompt_style == "toy" else oracle_actions(task)
    try:
        msgs = ep.reset()
        turns = []
        for action in actions:
            r = ep.step(action)
            turns.append({"action": action, "observation": r.observation})
            if r.done:
                break
        return msgs, turns, ep.score()
    finally:
        ep.close()
