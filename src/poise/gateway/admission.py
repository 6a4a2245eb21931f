"""The gateway's admission queue: requests wait here, best first, while their pool is saturated.

A pool is saturated when the requests the gateway has let through to it reach its capacity:
``max_inflight_per_backend`` (times weight) for each eligible backend whose own report (waiting
requests, KV usage) says it has room; one that never reported (no Prometheus metrics) is bounded
by the in-flight limit alone, and so is a poise replica, whose own admission judges its queue
(by priority, and by whether it drains) better than its reported length can. A stale report
counts as its last word only while the backend's health checks still pass (as recently as a
report must be fresh): its metrics are what is slow
(vLLM's ``/metrics`` under load, a gateway short of CPU), not the backend, so a stale report
that said there was room does not shed a pool whose probes pass. Otherwise silence counts as
saturation: a hung process stops answering its probes and its reports in the same round.

Capacity is counted per priority, as a replica's queue is: a request competes only with those
let through of a priority at least as good as its own (lower values are better, as in vLLM). A
flood of batch work that fills the pool's capacity therefore holds no interactive request at
the gateway: the replicas schedule by priority and preempt the batch work for it, so the
gateway lets it through, and holds back only more batch work.

A poise replica that refused a request for load refuses that priority and worse for a moment
(``Backend.note_shedding``); while every eligible backend has said so more than once for this
priority or a better one (``SHED_CONFIRM``), such a request is refused
here (429, ``Retry-After``) without being forwarded: a flood's refusals cost the replicas'
cores nothing, and the cores stay with the work they admitted.

Waiting requests are ordered by priority, then arrival (``PriorityLine``): when room appears,
the best goes first; when the line is full, the lowest priority is shed with 429 and
``Retry-After``; when nobody can be shed, the newcomer gets 503. A request that waits past the
queue's TTL or its own deadline is refused too, so nobody waits unseen and forever.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from poise.gateway.config import AdmissionSettings
from poise.gateway.pool import Pool
from poise.protocol import APIError
from poise.resilience.priority_queue import PriorityLine, QueueConfig

PUMP_INTERVAL_S = 0.02  # how often a waiting line rechecks reported load and TTLs


class PoolGate:
    def __init__(
        self,
        pool: Pool,
        settings: AdmissionSettings,
        clock: Callable[[], float],
        on_refusal: Callable[[str, str], None] = lambda model, reason: None,
        hold_shedding: bool = True,
    ) -> None:
        """``hold_shedding``: refuse at once what every backend sheds (else let it through,
        for a fallback model or a stored answer to serve)."""
        self.hold_shedding = hold_shedding
        self.pool = pool
        self.settings = settings
        self.clock = clock
        self.on_refusal = on_refusal
        self.line = PriorityLine(QueueConfig(settings.max_queue, settings.queue_ttl_s), clock)
        self._admitted: dict[int, int] = {}  # let through and not yet finished, by priority
        self._waiters: dict[int, tuple[int, asyncio.Future[None]]] = {}  # with their priority
        self._ids = itertools.count()
        self._pump: asyncio.Task[None] | None = None

    def capacity(self) -> float:
        s, pool = self.settings, self.pool
        total = 0.0
        for b in pool.eligible():
            load = b.load
            if load.at is not None:
                stale = pool.older_than_a_report_may_be(load.at)
                if stale and (b.passed_at is None or pool.older_than_a_report_may_be(b.passed_at)):
                    continue
                # A poise replica's admission judges its own queue and pool, by priority and
                # by whether the queue drains: it refuses (at once) what it cannot take, and
                # the gateway takes that as it comes. Its queue length, reported whatever the
                # priorities in it, would hold an interactive request here behind a batch one.
                full = load.waiting >= s.max_backend_waiting or load.kv_usage >= s.max_kv_usage
                if full and b.kind != "poise":
                    continue
            total += s.max_inflight_per_backend * b.settings.weight
        return total

    @property
    def admitted(self) -> int:
        """Let through and not yet finished, of every priority."""
        return sum(self._admitted.values())

    @property
    def saturated(self) -> bool:
        """Saturated for the lowest priority: nothing more gets through without a better one."""
        return self.admitted >= self.capacity()

    def saturated_for(self, priority: int) -> bool:
        let_through = sum(n for p, n in self._admitted.items() if p <= priority)
        return let_through >= self.capacity()

    async def enter(
        self, priority: int, deadline: float, first_token_by: float | None = None
    ) -> None:
        """Return when the request may go to the pool (then ``leave`` once it is done).
        ``first_token_by``: its own first-token objective's due time: a patient one is not held
        back while the backends shed its priority (they spare it), and none waits here past it
        (429: it would reach a backend too late for its objective)."""
        eligible = self.pool.eligible()
        now = self.clock()
        left = None if first_token_by is None else first_token_by - now
        shed = eligible and all(b.sheds(priority, now, left) for b in eligible)
        if self.hold_shedding and shed:
            # Each refused this priority for load a moment ago: say so here, at once, rather
            # than forward a flood's requests only to carry their refusals back.
            raise self._refusal(
                "shedding",
                429,
                f"every backend of model {self.pool.model!r} is refusing requests of priority "
                f"{priority} or worse for load; try again shortly",
                code="overloaded",
            )
        best_waiting = self.line.best_priority()
        ahead = best_waiting is not None and best_waiting <= priority
        if (not ahead and not self.saturated_for(priority)) or not eligible:
            # With nothing eligible there is nothing to wait for: the forwarder will say why.
            self._let_through(priority)
            return
        ident = next(self._ids)
        offer = self.line.offer(ident, priority)
        if not offer.queued:
            raise self._refusal(
                "queue_full",
                503,
                f"the gateway's queue for model {self.pool.model!r} is full "
                f"({self.settings.max_queue} waiting)",
            )
        for victim in offer.shed:
            self._refuse(victim, "shed", "shed from the gateway's queue for higher-priority work")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[ident] = (priority, waiter)
        if self._pump is None:
            self._pump = asyncio.create_task(self._run_pump())
        until = deadline if first_token_by is None else min(first_token_by, deadline)
        objective_first = until < deadline
        try:
            async with asyncio.timeout(max(0.0, until - self.clock())):
                await waiter
        except TimeoutError:
            self._forget(ident)
            if _admitted(waiter):  # let in by the same loop pass that ended its wait
                self.leave(priority)
            if objective_first:
                raise self._refusal(
                    "slo_ttft",
                    429,
                    "the request's first-token objective (x-slo-ttft-ms) passed in the "
                    "gateway's queue",
                ) from None
            self.on_refusal(self.pool.model, "deadline")
            raise APIError(
                504, "the request's deadline passed in the gateway's queue", code="timeout"
            ) from None
        except BaseException:  # the client left; give back a place we may already hold
            self._forget(ident)
            if _admitted(waiter):
                self.leave(priority)
            raise

    def leave(self, priority: int) -> None:
        """A request let through with this priority is done."""
        left = self._admitted.get(priority, 0) - 1
        if left > 0:
            self._admitted[priority] = left
        else:
            self._admitted.pop(priority, None)
        self._admit()

    def _let_through(self, priority: int) -> None:
        self._admitted[priority] = self._admitted.get(priority, 0) + 1

    def _forget(self, ident: int) -> None:
        self.line.remove(ident)
        self._waiters.pop(ident, None)

    def _refusal(self, reason: str, status: int, message: str, code: str | None = None) -> APIError:
        """A refusal for load, counted under ``reason``: the client may try again in a second."""
        self.on_refusal(self.pool.model, reason)
        return APIError(status, message, code=code or reason, headers={"Retry-After": "1"})

    def _refuse(self, ident: object, reason: str, message: str) -> None:
        entry = self._waiters.pop(ident, None)  # type: ignore[call-overload]
        error = self._refusal(reason, 429, message)
        if entry is not None and not entry[1].done():
            entry[1].set_exception(error)

    def _admit(self) -> None:
        while True:
            best = self.line.best_priority()
            if best is None or self.saturated_for(best):
                return
            ident = self.line.pop()
            entry = self._waiters.pop(ident, None)  # type: ignore[call-overload]
            if entry is not None and not entry[1].done():
                self._let_through(entry[0])
                entry[1].set_result(None)

    async def _run_pump(self) -> None:
        try:
            while self.line:
                self._admit()
                for ident in self.line.expire():
                    self._refuse(
                        ident,
                        "queue_ttl",
                        f"waited longer than {self.settings.queue_ttl_s:g}s in the gateway's queue",
                    )
                await asyncio.sleep(PUMP_INTERVAL_S)
        finally:
            self._pump = None


def _admitted(waiter: asyncio.Future[None]) -> bool:
    """The waiter was given a place (which the request, now leaving, must give back)."""
    return waiter.done() and not waiter.cancelled() and waiter.exception() is None
