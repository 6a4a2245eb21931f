"""A backend's answer as the gateway holds it (``Upstream``), and what it reads of one: the
usage's output tokens, an error's code and message, ``Retry-After``, the headers passed on."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from poise.gateway.outcome import Outcome
from poise.gateway.pool import Backend

# Usage sits at the end of a completion; a search of the tail is cheaper than parsing it all.
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


@dataclass(slots=True, eq=False)  # hashed by identity: a key of Backend.movable
class Upstream:
    """A committed upstream response: status, headers, and (for streams) its open body."""

    status: int
    headers: dict[str, str]
    body: bytes | None  # whole body (non-streaming); None for a stream
    first_chunk: bytes = b""
    chunks: AsyncIterator[bytes] | None = None
    response: aiohttp.ClientResponse | None = None
    backend: Backend | None = None
    outcome: Outcome | None = None

    def close(self, reusable: bool) -> None:
        """Give the connection back (a body read to its end) or drop it (anything else)."""
        if self.response is not None:
            if reusable:
                self.response.release()
            else:
                self.response.close()


def output_tokens(body: bytes) -> int | None:
    """The completion tokens a whole answer's usage reports, if it does."""
    match = _COMPLETION_TOKENS.search(body[-400:])
    return None if match is None else int(match.group(1))


def error_code(data: bytes) -> str | None:
    try:
        code = json.loads(data)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return code if isinstance(code, str) else None


def error_message(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return data[:200].decode(errors="replace")


def retry_after_s(response: aiohttp.ClientResponse) -> float | None:
    raw = response.headers.get("retry-after")
    try:
        return None if raw is None else min(60.0, max(0.0, float(raw)))
    except ValueError:
        return None


HOP_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "server", "date"}
)


def passed_headers(response: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
