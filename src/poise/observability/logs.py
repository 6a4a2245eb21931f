"""Structured logs: one JSON object per line for machines, a readable line on a terminal.

Every logger in the process (poise's, uvicorn's, libraries') goes through one structlog
``ProcessorFormatter`` on the standard library's logging, so a collector reads one format.
Fields passed with ``extra=`` become keys of the line; request lines carry the request id,
the trace id, model, backend, outcome and timings, never prompt or completion text.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import IO, Literal

import structlog

LogFormat = Literal["auto", "json", "console"]

# A line per health check or connection is noise, not news, unless asked for by name.
QUIET_LIBRARIES = ("httpx", "httpcore", "aiohttp.access", "uvicorn.access")


def _drop_color_message(
    logger: object, method: str, event: structlog.types.EventDict
) -> structlog.types.EventDict:
    event.pop("color_message", None)  # uvicorn's copy of the message with terminal colours
    return event


def _drop_empty(
    logger: object, method: str, event: structlog.types.EventDict
) -> structlog.types.EventDict:
    return {k: v for k, v in event.items() if v is not None}


def ms(seconds: float | None) -> float | None:
    """A duration as a log line shows it: milliseconds, two decimals (None stays None)."""
    return None if seconds is None else round(1000 * seconds, 2)


def configure_logging(
    level: str = "info",
    levels: Mapping[str, str] | None = None,
    fmt: LogFormat = "auto",
    stream: IO[str] | None = None,
) -> None:
    """Route all logging to ``stream`` (stderr) in ``fmt``; ``levels`` by logger name."""
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    shared: list[structlog.types.Processor] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    shared.append(_drop_color_message)
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.dict_tracebacks)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
        shared.append(_drop_empty)  # a person reads this: only the fields that say something
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    quiet = max(logging.WARNING, logging.getLevelName(level.upper()))
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(quiet)
    for name in ("uvicorn", "uvicorn.error"):
        # uvicorn's own handlers would print a second, differently shaped line.
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    for name, lvl in (levels or {}).items():
        logging.getLogger(name).setLevel(lvl.upper())
