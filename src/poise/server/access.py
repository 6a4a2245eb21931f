"""How a replica request ended, told once: its log line and its span, on every path.

The engine reports each choice's timings when it finishes (arrival, first scheduled, first
token, finish); the HTTP side reports the status. Whichever way the request ends (answer, error,
refusal, a client gone, a stream cut), ``end`` runs once and writes one JSON line on
``poise.server.access`` (never the prompt or the answer) and closes the trace's span.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from poise.observability.logs import ms
from poise.observability.tracing import RequestTrace, trace_id

log = logging.getLogger("poise.server.access")


@dataclass(slots=True)
class RequestReport:
    request_id: str | None
    path: str
    model: str | None
    stream: bool
    started: float = field(default_factory=time.perf_counter)
    trace: RequestTrace | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    queue_s: float | None = None
    ttft_s: float | None = None
    ended: bool = False
    user: str | None = None  # OpenAI's ``user``: the client's name for its end user, logged

    def engine_done(
        self,
        arrival: float,
        scheduled: float | None,
        first_token: float | None,
        finished: float | None,
        output_tokens: int,
        finish_reason: str,
    ) -> None:
        if self.trace is not None:
            self.trace.add_phases(arrival, scheduled, first_token, finished)
        self.output_tokens += output_tokens
        self.finish_reasons.append(finish_reason)
        if scheduled is not None and self.queue_s is None:
            self.queue_s = scheduled - arrival
        if first_token is not None and self.ttft_s is None:
            self.ttft_s = first_token - arrival

    def end(self, status: int, error: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        output_tokens = self.output_tokens if self.finish_reasons else None
        if self.trace is not None:
            self.trace.end(status, error, output_tokens, self.finish_reasons)
        if not log.isEnabledFor(logging.INFO):
            return
        log.info(
            "request",
            extra={
                "request_id": self.request_id,
                "trace_id": trace_id(self.trace.span) if self.trace is not None else None,
                "path": self.path,
                "model": self.model,
                "stream": self.stream,
                "user": self.user,
                "status": status,
                "prompt_tokens": self.prompt_tokens,
                "output_tokens": output_tokens,
                "finish_reasons": self.finish_reasons or None,
                "queue_ms": ms(self.queue_s),
                "ttft_ms": ms(self.ttft_s),
                "duration_ms": ms(time.perf_counter() - self.started),
                "error": error,
            },
        )

    async def wrap(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A stream whose end, however it comes, ends the report (499: the client left)."""
        status = 499
        try:
            async for chunk in events:
                yield chunk
            status = 200
        finally:
            await events.aclose()  # type: ignore[attr-defined]
            self.end(status)
