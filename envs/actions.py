"""The agent's action format and the observations it gets back.

One turn = free text with exactly one fenced ```bash block (the mini-swe-agent convention): the
block's content runs with `bash -c` in the workspace. Observations are plain text the worker
appends after the generated ids as they are; earlier turns are never re-rendered.
"""

from __future__ import annotations

import re

BASH_BLOCK = re.compile(r"```bash[ \t]*\n(.*?)```", re.S)
SUBMIT = "submit"


def parse_action(text: str) -> tuple[str | None, str]:
    """(command, "") for a turn with exactly one ```bash block, else (None, why)."""
    blocks = BASH_BLOCK.findall(text or "")
    if len(blocks) != 1:
        return None, (f"found {len(blocks)} ```bash blocks" if blocks else "found no ```bash block")
    command = blocks[0].strip("\n")
    if not command.strip():
        return None, "the ```bash block is empty"
    return command, ""


def is_submit(command: str) -> bool:
    return command.strip() == SUBMIT


def is_run_tests(command: str) -> bool:
    """A command that is just the test helper (with its arguments): one line, no shell operators."""
    c = command.strip()
    return (c == "run_tests" or c.startswith("run_tests ")) and not re.search(r"[\n;&|<>`$()]", c)


def failures_summary(output: str) -> str:
    """A test run's output cut to what names the failures: the runners' `FAILED <id>` / `ERROR ...`
    lines and the last line (the summary, e.g. `3 passed, 1 failed`). Tracebacks are dropped."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    keep = [ln for ln in lines[:-1] if ln.startswith(("FAILED ", "ERROR "))]
    return "\n".join(keep + lines[-1:])


def cut_lines(text: str, head: int, tail: int, max_line_chars: int) -> str:
    """The first `head` and last `tail` lines (each at most `max_line_chars`), the middle replaced
    by a note, so a chatty command cannot blow up the context."""
    lines = text.splitlines()
    lines = [
        ln if len(ln) <= max_line_chars else ln[:max_line_chars] + f" [... {len(ln) - max_line_chars} chars]"
        for ln in lines
    ]
    if len(lines) > head + tail:
        lines = (
            lines[:head]
            + [f"[... {len(lines) - head - tail} lines omitted ...]"]
            + (lines[-tail:] if tail else [])
        )
    return "\n".join(lines)


def command_observation(
    returncode: int, output: str, warning: str = "", head: int = 40, tail: int = 40, max_line_chars: int = 300
) -> str:
    body = cut_lines(output, head, tail, max_line_chars)
    warn = f"<warning>{warning}</warning>\n" if warning else ""
    return f"{warn}<returncode>{returncode}</returncode>\n<output>\n{body}\n</output>"


def format_error_observation(why: str) -> str:
    return (
        f"<format_error>{why}. Reply with a short thought and exactly one ```bash block "
        f"containing the command to run; use `submit` alone in the block when done.</format_error>"
    )
