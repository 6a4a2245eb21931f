"""A circuit breaker per backend on error rate *and* slow-call rate (SPEC formula 4).

CLOSED: calls pass; the outcomes of the last ``window_size`` calls (no older than
``window_s``) are kept. Once at least ``min_calls`` are in the window and the share of failures
reaches ``failure_rate`` or the share of calls slower than ``slow_call_s`` reaches
``slow_call_rate``, the breaker OPENs. OPEN: calls are refused for ``open_s``. HALF_OPEN: up to
``half_open_calls`` probe calls are let through; when all have reported, the same two rates
over just those calls decide CLOSED (window cleared) or OPEN again.

Each permit is a token naming the phase it was taken in. Only calls let through in the current
phase count: a call that began while the breaker was closed and ends while it is half-open is
not a probe result and frees no probe's permit.

A call is slow by what a backend controls, never by how long its answer is (``CallTiming``):
its longest silence (the wait for the first byte, or a gap between streamed events) reaching
``slow_call_s``, or its whole duration exceeding ``slow_call_s`` plus ``slow_token_s`` for each
output token. A healthy 2,000-token answer is long, not slow.

As resilience4j's count-based window, with an age limit so that failures from long ago cannot
trip a breaker on the first error of a quiet day. Pure: the clock is injected.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_rate: float = 0.5
    slow_call_rate: float = 0.8
    slow_call_s: float = 10.0
    slow_token_s: float = 1.0
    window_size: int = 50
    window_s: float = 60.0
    min_calls: int = 10
    open_s: float = 10.0
    half_open_calls: int = 3

    def __post_init__(self) -> None:
        if not (0 < self.failure_rate <= 1 and 0 < self.slow_call_rate <= 1):
            raise ValueError("breaker rates must be in (0, 1]")
        if self.window_size < 1 or self.min_calls < 1 or self.half_open_calls < 1:
            raise ValueError("breaker window, min_calls and half_open_calls must be >= 1")
        if min(self.open_s, self.slow_call_s, self.slow_token_s, self.window_s) <= 0:
            raise ValueError("breaker durations must be positive")


@dataclass(frozen=True, slots=True)
class CallTiming:
    """How one call went, in the terms the slow-call rule reads."""

    duration_s: float  # the backend's time: from the call's start, less any client's pace
    longest_silence_s: float = 0.0  # to the first byte, or between two streamed events
    output_tokens: int | None = 0  # None: not known (then only silence can tell)

    def slow(self, config: BreakerConfig) -> bool:
        if self.longest_silence_s >= config.slow_call_s:
            return True
        if self.output_tokens is None:
            return False
        return self.duration_s > config.slow_call_s + self.output_tokens * config.slow_token_s


class Permit:
    """The right to one call, taken in one phase of one breaker; hashed by identity."""

    __slots__ = ("phase", "probe")

    def __init__(self, phase: int, probe: bool) -> None:
        self.phase = phase
        self.probe = probe


@dataclass(frozen=True, slots=True)
class _Call:
    at: float
    failed: bool
    slow: bool


class CircuitBreaker:
    def __init__(
        self,
        config: BreakerConfig,
        clock: Callable[[], float],
        on_change: Callable[[BreakerState, BreakerState], None] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.on_change = on_change
        self._state = BreakerState.CLOSED
        self._window: deque[_Call] = deque(maxlen=config.window_size)
        self._opened_at = 0.0
        self._phase = 0  # moves on with every change of state
        self._probes_out: set[Permit] = set()
        self._probe_results: list[_Call] = []
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        if (
            self._state is BreakerState.OPEN
            and self.clock() - self._opened_at >= self.config.open_s
        ):
            self._move(BreakerState.HALF_OPEN)
        return self._state

    def open_for(self) -> float:
        """Seconds until an OPEN breaker lets probes through; 0 when it is not open."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._opened_at + self.config.open_s - self.clock())

    def allows(self) -> bool:
        """Could a call go now? Does not take a half-open permit (for routing decisions)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN:
            return len(self._probes_out) + len(self._probe_results) < self.config.half_open_calls
        return False

    def acquire(self) -> Permit | None:
        """The right to make one call, or None; every permit must be followed by exactly one
        ``record`` or ``release``."""
        if not self.allows():
            return None
        permit = Permit(self._phase, self._state is BreakerState.HALF_OPEN)
        if permit.probe:
            self._probes_out.add(permit)
        return permit

    def release(self, permit: Permit) -> None:
        """The call was abandoned without an outcome (the client left): give its permit back."""
        self._probes_out.discard(permit)

    def record(self, permit: Permit, ok: bool, timing: CallTiming) -> None:
        state = self.state
        if permit.phase != self._phase:
            return  # let through in an earlier phase: it says nothing about this one
        call = _Call(self.clock(), not ok, timing.slow(self.config))
        if state is BreakerState.HALF_OPEN:
            if permit not in self._probes_out:
                return
            self._probes_out.discard(permit)
            self._probe_results.append(call)
            if len(self._probe_results) >= self.config.half_open_calls:
                if self._tripped(self._probe_results):
                    self._open()
                else:
                    self._window.clear()
                    self._move(BreakerState.CLOSED)
            return
        self._window.append(call)
        horizon = call.at - self.config.window_s
        while self._window and self._window[0].at < horizon:
            self._window.popleft()
        if len(self._window) >= self.config.min_calls and self._tripped(self._window):
            self._open()

    def _tripped(self, calls: deque[_Call] | list[_Call]) -> bool:
        n = len(calls)
        failures = sum(c.failed for c in calls)
        slow = sum(c.slow for c in calls)
        return failures >= self.config.failure_rate * n or slow >= self.config.slow_call_rate * n

    def _open(self) -> None:
        self._opened_at = self.clock()
        self.times_opened += 1
        self._move(BreakerState.OPEN)

    def _move(self, to: BreakerState) -> None:
        before, self._state = self._state, to
        self._phase += 1
        self._probes_out = set()
        self._probe_results = []
        if self.on_change is not None and before is not to:
            self.on_change(before, to)
