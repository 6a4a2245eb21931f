"""Retries that cannot become a storm: backoff with full jitter, a deadline cap, a budget.

Backoff: the n-th retry waits a uniform draw from [0, min(cap, base·2^n)] (AWS's "full
jitter"), or the server's ``Retry-After`` when it gave one and it is longer. A retry whose wait
would not leave ``min_attempt_s`` before the request's deadline is not made.

Budget (as Envoy's retry budget and the SRE book's per-client budget), two bounds at once:
retries in flight may not exceed ``ratio`` x requests in flight, and retries made over the last
``window_s`` may not exceed ``ratio`` x requests begun in it. Each bound has a floor so that a
quiet gateway can still retry: ``min_concurrent`` in flight, and ``min_per_s`` a second over the
window (as Finagle's ``minRetriesPerSec``); under load the ratio is the bound. A retry is in
flight from its grant until the attempt it bought has answered. When backends fail together,
every request would retry at once and multiply the load on whatever is left; the budget caps
the extra calls at ``ratio`` of the requests.

Pure: the random source is injected; the budget is a counter the caller holds across calls.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_retries: int = 2
    base_s: float = 0.05
    cap_s: float = 2.0
    min_attempt_s: float = 0.05  # a retry must leave at least this much before the deadline

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_s < 0 or self.cap_s < self.base_s:
            raise ValueError("retry policy: max_retries >= 0 and 0 <= base_s <= cap_s")

    def delay_s(
        self,
        retry: int,
        rng: random.Random,
        retry_after_s: float | None = None,
        time_left_s: float | None = None,
    ) -> float | None:
        """The wait before retry number ``retry`` (0-based), or None: do not retry."""
        if retry >= self.max_retries:
            return None
        delay = rng.uniform(0, min(self.cap_s, self.base_s * (2**retry)))
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        if time_left_s is not None and delay + self.min_attempt_s > time_left_s:
            return None
        return delay


class RetryBudget:
    def __init__(
        self,
        ratio: float = 0.2,
        min_concurrent: int = 3,
        window_s: float = 10.0,
        min_per_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= ratio <= 1 or min(min_concurrent, min_per_s) < 0 or window_s <= 0:
            raise ValueError(
                "retry budget: ratio in [0, 1], min_concurrent and min_per_s >= 0, window_s > 0"
            )
        self.ratio = ratio
        self.min_concurrent = min_concurrent
        self.window_s = window_s
        self.min_per_s = min_per_s
        self.clock = clock
        self.active_requests = 0
        self.active_retries = 0
        self.refused_total = 0
        self.peak_retries = 0
        self._requests: deque[float] = deque()  # when each request of the window began
        self._retries: deque[float] = deque()  # when each retry of the window was granted

    @property
    def limit(self) -> int:
        """Retries that may be in flight at once now."""
        return max(self.min_concurrent, int(self.ratio * self.active_requests))

    def window_limit(self) -> int:
        """Retries that may be granted over the window now."""
        self._forget_before(self.clock() - self.window_s)
        floor = int(self.min_per_s * self.window_s)
        return max(floor, int(self.ratio * len(self._requests)))

    def request_started(self) -> None:
        now = self.clock()
        self.active_requests += 1
        self._requests.append(now)
        self._forget_before(now - self.window_s)  # memory: the window's requests, no more

    def request_ended(self) -> None:
        self.active_requests = max(0, self.active_requests - 1)

    def try_retry(self) -> bool:
        """Take a retry slot; each True needs one ``retry_ended`` once the retried attempt has
        answered."""
        window_limit = self.window_limit()  # forgets what the window has left behind
        if self.active_retries >= self.limit or len(self._retries) >= window_limit:
            self.refused_total += 1
            return False
        self.active_retries += 1
        self._retries.append(self.clock())
        self.peak_retries = max(self.peak_retries, self.active_retries)
        return True

    def retry_ended(self) -> None:
        self.active_retries = max(0, self.active_retries - 1)

    def _forget_before(self, horizon: float) -> None:
        for times in (self._requests, self._retries):
            while times and times[0] < horizon:
                times.popleft()
