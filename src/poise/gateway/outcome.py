"""How one attempt on a backend is closed: its verdict (breaker, outlier detection, the
latency the router reads, metrics) given exactly once, and how it is cut off when its backend is
found dead while it waits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from opentelemetry import trace

from poise.gateway.pool import Backend, Pool
from poise.resilience.breaker import CallTiming, Permit
from poise.resilience.latency import StreamTimer


class CutOff:
    """How an attempt still waiting for its backend's answer is cut off when that backend is
    found dead: its task is cancelled, and the attempt tells that cancellation from the
    client's by ``fired``. Armed only while the attempt awaits the backend, so a cancellation
    always lands inside the attempt's own ``try``."""

    __slots__ = ("armed", "fired", "task")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.armed = task is not None
        self.fired = False

    def fire(self) -> None:
        if self.armed and self.task is not None:
            self.armed = False
            self.fired = True
            self.task.cancel()


class Outcome:
    """Closes one attempt exactly once: in-flight count, breaker, outlier detection, metrics."""

    def __init__(
        self,
        clock: Callable[[], float],
        on_outcome: Callable[[Backend, str, bool, str], None],
        pool: Pool,
        backend: Backend,
        permit: Permit,
        started: float,
        span: trace.Span | None = None,
        timer: StreamTimer | None = None,
        first: bool = False,
        priority: int | None = None,
    ) -> None:
        self.clock, self.on_outcome = clock, on_outcome
        self.pool, self.backend, self.started = pool, backend, started
        self.permit = permit  # the breaker's, given back exactly once
        self.span = span  # the attempt's; it lasts as long as the attempt, stream included
        self.timer = timer  # the stream's, fed by the relay
        self.first = first  # the request's first attempt (its pool's first pick)
        self.priority = priority  # the one it was sent with: its in-flight count is under it
        self.closed = False

    def _end_span(self, outcome: str) -> None:
        if self.span is not None:
            self.span.set_attribute("poise.outcome", outcome)
            if outcome not in ("ok", "abandoned"):
                self.span.set_status(trace.StatusCode.ERROR, outcome)
            self.span.end()

    def done(
        self,
        outcome: str,
        tokens: int | None = None,
        answered: bool = False,
        recovery: str = "retry",
    ) -> None:
        """``tokens``: the output tokens of a whole (non-streamed) answer, when it says;
        ``answered``: the outcome is the status the backend answered with, before any output;
        ``recovery``: what the gateway does about a failure (formula 2's odds): retry (within
        policy and budget), move (at once, elsewhere), resume (a broken stream), none."""
        if self.closed:
            return
        self.closed = True
        self._end_span(outcome)
        now = self.clock()
        elapsed = now - self.started
        if outcome == "deadline" and (self.timer is None or not self.timer.count):
            # Silent until the request's time ran out: no failure, but a slow call if that
            # silence reached slow_call_s (a hung backend must not escape every verdict). A
            # stream that was answering when the time ran out is timed as any stream.
            timing = CallTiming(elapsed, elapsed, None)
        elif self.timer is not None:
            # A stream: only the time spent waiting on the backend's reads is its own.
            backend_s, longest_wait = self.timer.waits(now)
            timing = CallTiming(backend_s, longest_wait, self.timer.count)
        else:
            # A whole answer is silent until complete: only its time per token can tell, and
            # only when it says how many tokens it has.
            timing = CallTiming(elapsed, 0.0, tokens)
        if self.timer is not None:
            self.timer.close()
        self.backend.attempt_ended(self.priority)
        # 429 ("overloaded") is a busy backend, not a broken one: it does not count against it;
        # nor does a request whose own deadline ran out while the backend worked on it.
        failed = outcome in ("error", "timeout", "connect_error")
        if outcome == "overloaded":
            self.backend.breaker.release(self.permit)
        else:
            self.backend.breaker.record(self.permit, not failed, timing)
        if outcome != "deadline":
            self.pool.judge(self.backend, not failed, error_answer=answered)
        self.on_outcome(self.backend, outcome, self.first, recovery)

    def abandon(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._end_span("abandoned")
        if self.timer is not None:
            self.timer.close()
        self.backend.attempt_ended(self.priority)
        self.backend.breaker.release(self.permit)
