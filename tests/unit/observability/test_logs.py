"""The log formats: one JSON object per line, or a readable line; levels by logger name."""

from __future__ import annotations

import io
import json
import logging

import pytest

from poise.observability.logs import configure_logging


@pytest.fixture(autouse=True)
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("poise.gateway.health").setLevel(logging.NOTSET)


def test_json_lines_carry_the_extra_fields_and_exceptions():
    out = io.StringIO()
    configure_logging("info", fmt="json", stream=out)
    logging.getLogger("poise.gateway.access").info(
        "request", extra={"request_id": "r1", "status": 200}
    )
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("poise.server").exception("failed")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["event"] == "request" and first["request_id"] == "r1" and first["status"] == 200
    assert first["level"] == "info" and first["logger"] == "poise.gateway.access"
    assert first["timestamp"].endswith("Z")
    assert second["level"] == "error" and "ValueError" in json.dumps(second["exception"])


def test_console_format_and_levels_by_logger_name():
    out = io.StringIO()
    configure_logging("warning", {"poise.gateway.health": "debug"}, fmt="console", stream=out)
    logging.getLogger("poise.gateway.health").debug("probe ok")
    logging.getLogger("poise.gateway").info("not shown")
    text = out.getvalue()
    assert "probe ok" in text and "not shown" not in text
    assert not text.lstrip().startswith("{")


def test_auto_is_json_when_not_a_terminal():
    out = io.StringIO()  # isatty() is False
    configure_logging("info", stream=out)
    logging.getLogger("poise").info("hello")
    assert json.loads(out.getvalue())["event"] == "hello"


def test_console_lines_leave_out_empty_fields_and_uvicorns_colours():
    out = io.StringIO()
    configure_logging("info", fmt="console", stream=out)
    # warning: an earlier test's uvicorn may have set this logger's level to warning
    logging.getLogger("uvicorn.error").warning(
        "started", extra={"color_message": "\x1b[36mstarted\x1b[0m", "trace_id": None}
    )
    text = out.getvalue()
    assert "started" in text and "color_message" not in text and "trace_id" not in text
