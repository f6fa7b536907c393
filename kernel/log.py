"""Logging: structlog, JSON lines when the log stream is not a TTY, pretty console otherwise.

Every record carries `component` and `component_id`, so the lines of many processes can be
merged and filtered (`jq 'select(.component=="scorer")'`). Logs go to stderr: stdout is kept
for results (benchmarks print one JSON object there).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def setup_logging(
    component: str,
    json: bool | None = None,
    *,
    component_id: str | None = None,
    level: str = "info",
    log_file: str | None = None,
    stream: TextIO | None = None,
) -> None:
    """Configure structlog for this process. `json=None` picks JSON when `stream` is not a TTY."""
    stream = stream or sys.stderr
    if level.lower() not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {sorted(_LEVELS)}")
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    static = {"component": component, "component_id": component_id or component}

    def add_component(_, __, event: dict[str, Any]) -> dict[str, Any]:
        for k, v in static.items():
            event.setdefault(k, v)
        return event

    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_component,
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    json_renderer = structlog.processors.JSONRenderer()
    console = json_renderer if json else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    logfile = open(log_file, "a", buffering=1) if log_file else None

    def render(logger, name, event: dict[str, Any]) -> str:
        if logfile is not None:  # the file always gets JSON lines, whatever the console shows
            logfile.write(json_renderer(logger, name, dict(event)) + "\n")
        return console(logger, name, event)

    structlog.configure(
        processors=[*shared, render],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level.lower()]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # stdlib logging (nats-py, asyncio) goes to the same stream at warning+
    logging.basicConfig(
        level=logging.WARNING, stream=stream, format="%(levelname)s %(name)s: %(message)s", force=True
    )


def get_logger(name: str | None = None, **bound: Any):
    """A lazy logger: module-level loggers pick up setup_logging() called later (no bind() here:
    binding a lazy proxy would freeze the configuration of import time)."""
    return structlog.get_logger(**({"src": name} if name else {}), **bound)
