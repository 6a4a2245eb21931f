"""One replica's serving state: admission, in-flight requests, health, drain.

Everything between a validated HTTP request and the engine's output stream lives here, with no
knowledge of the OpenAI wire format (``openai_api`` formats) or of the HTTP framework (``app``).
Each engine request is tracked from admission to its end; on every path (finished, failed,
shed, drained, client gone) the ``finally`` of its pump gives back its admission slot, and the
engine frees its blocks because an abandoned stream aborts its request.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from poise.config import ServerSettings
from poise.engine.client import EngineClient
from poise.engine.errors import CANNOT_FINISH, EngineDeadError, InvalidRequestError
from poise.engine.intake import RequestOptions, Resume
from poise.engine.outputs import RequestOutput
from poise.engine.request import Request, SamplingParams
from poise.protocol import (
    DEADLINE_HEADER,
    SHEDDING_HEADER,
    SPARES_HEADER,
    TPOT_SLO_HEADER,
    TTFT_SLO_HEADER,
    APIError,
    deadline_budget_s,
    objective_s,
)
from poise.resilience.admission import AdmissionConfig, AdmissionController, Need, Objective
from poise.resilience.queue_trend import TrendConfig
from poise.server.access import RequestReport
from poise.server.metrics import EngineSnapshot, ServerMetrics

log = logging.getLogger("poise.server")

PROBE_PRIORITY = -(2**31)
DEADLINE_GRACE_S = 0.25


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


@dataclass(slots=True)
class Prepared:
    request: Request
    text: str | None
    report: RequestReport | None = None  # told the engine's timings when it finishes


@dataclass(frozen=True, slots=True)
class Terms:
    """What a request asks of its service besides its body: its priority; when it must be done
    (``X-Request-Deadline-Ms``, else the server's default timeout) and its latency objective
    (``x-slo-ttft-ms``, ``x-slo-tpot-ms``), on the server's clock; ``continues``: the gateway's
    continuation of a stream its client is already receiving."""

    priority: int = 0
    deadline: float | None = None
    objective: Objective | None = None
    continues: bool = False


@dataclass(slots=True)
class _InFlight:
    key: str
    prompt_tokens: int
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    override: APIError | None = None  # why we ended it ourselves (shed, drain)


def _end_error(reason: str | None, detail: str | None, override: APIError | None) -> APIError:
    if override is not None:
        return override
    if reason == "timeout":
        if detail and detail.startswith(CANNOT_FINISH):  # ended early, not at the deadline
            return APIError(504, f"the request was ended: {detail}", code="timeout")
        return APIError(504, "the request's deadline passed before it completed", code="timeout")
    if reason == "error":
        return APIError(500, detail or "the engine failed on this request", code="engine_error")
    return APIError(503, "the request was aborted by the server", code="aborted")


class Replica:
    def __init__(
        self,
        settings: ServerSettings,
        engine: EngineClient,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.clock = clock
        self.phase = Phase.LOADING
        self.model_name = settings.model_name
        self.admission = AdmissionController(
            AdmissionConfig(
                enabled=settings.admission_control,
                max_waiting_requests=settings.max_waiting_requests,
                max_waiting_tokens=settings.max_waiting_tokens,
                queue_target_s=settings.queue_target_s or None,
                trend=TrendConfig(burst_gap_s=settings.burst_gap_s),
            ),
            clock,
            # Read at each decision: the engine replaces its stats after every step.
            forecast=lambda: engine.stats.forecast,
        )
        self.metrics = ServerMetrics(self.model_name, self.snapshot)
        self.inflight: dict[str, _InFlight] = {}
        # Fault injection (``error_status``): every API request is answered with this status,
        # as a bad deploy or a broken dependency would; 0 is off.
        self.injected_error_status = 0

    # ----- health -----
    def health(self) -> tuple[bool, str]:
        if not self.engine.is_alive:
            return False, self.engine.dead_reason or "the engine loop is not running"
        stalled = self.clock() - self.engine.last_progress
        if stalled > self.settings.watchdog_stall_s:
            return False, (
                f"the engine loop has made no progress for {stalled:.1f}s "
                f"(limit {self.settings.watchdog_stall_s:g}s)"
            )
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        if self.phase is not Phase.READY:
            return False, self.phase.value
        ok, why = self.health()
        if not ok:
            return False, why
        if self.admission.saturated:
            return False, "saturated: the admission queue is full"
        return True, "ok"

    def snapshot(self) -> EngineSnapshot:
        stats = self.engine.stats
        healthy, _ = self.health()
        busy = self.engine.has_work
        return EngineSnapshot(
            running=stats.num_running,
            waiting=stats.num_waiting,
            kv_usage=stats.kv_usage,
            preemptions=stats.num_preemptions,
            room_waits=stats.num_room_waits,
            prefix_queried_tokens=stats.prefix_queried_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            step_errors=stats.step_errors,
            seconds_since_progress=self.clock() - self.engine.last_progress if busy else 0.0,
            healthy=healthy,
            ready=self.readiness()[0],
            admission_waiting=len(self.admission.waiting),
            admission_waiting_tokens=self.admission.waiting_tokens,
            predicted_wait_s=self.admission.predicted_wait(0),
            kv=stats.kv,
            kv_headroom_blocks=min(stats.forecast.kv_headroom_blocks, stats.num_free_blocks),
            queue_state=self.admission.trends.state,
        )

    @property
    def draining(self) -> bool:
        return self.phase is Phase.DRAINING

    def debug_state(self) -> dict[str, Any]:
        """The replica's live state for ``/debug/state``: engine, KV pool, admission, watchdog."""
        stats = self.engine.stats
        healthy, why = self.health()
        ready, ready_why = self.readiness()
        return {
            "role": "replica",
            "model": self.model_name,
            "phase": self.phase.value,
            "health": {"healthy": healthy, "reason": why},
            "ready": {"ready": ready, "reason": ready_why},
            "engine": {
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "preemptions_total": stats.num_preemptions,
                "room_waits_total": stats.num_room_waits,  # requests held for lack of KV room
                "step_errors_total": stats.step_errors,
                "seconds_since_progress": round(self.clock() - self.engine.last_progress, 3),
                "has_work": self.engine.has_work,
                "step_s": round(stats.forecast.step_s, 4),  # the forecast's recent step time
                "max_running": stats.max_running,
                "running_by_priority": stats.running_by_priority,
                "waiting_by_priority": stats.waiting_by_priority,
                "step_time_fit_ms": None
                if stats.step_time_fit is None
                else dict(
                    zip(
                        ("per_step", "per_decode", "per_prompt_token"),
                        (round(1000 * v, 3) for v in stats.step_time_fit),
                        strict=True,
                    )
                ),
            },
            "kv_cache": {
                "usage": stats.kv_usage,
                "free_blocks": stats.num_free_blocks,
                "total_blocks": stats.num_blocks,  # the pool, or what a fault limits it to
                "headroom_blocks": min(stats.forecast.kv_headroom_blocks, stats.num_free_blocks),
                "committed_blocks": stats.forecast.committed_blocks(
                    stats.num_blocks, stats.num_free_blocks
                ),
                "allocated_slots": stats.kv.allocated_slots,
                "unused_slots": stats.kv.unused_slots,
                "fragmentation": round(stats.kv.fragmentation, 4),
                "waiting_blocks": stats.kv.waiting_blocks,
                "preempted_blocks": stats.kv.preempted_blocks,
            },
            "admission": {
                "waiting_requests": len(self.admission.waiting),
                "waiting_prompt_tokens": self.admission.waiting_tokens,
                "predicted_wait_s": self.admission.predicted_wait(0),
                "saturated": self.admission.saturated,
                "queue_state": self.admission.trends.state,
                "wait_error_s": round(self.admission.wait_error(0), 4),
                "arrived_served": list(self.admission.trends.counts()),
                "arrived_served_long": list(self.admission.trends.counts(long=True)),
                "start_pace": self.admission.paces(),
            },
            "inflight_requests": len(self.inflight),
        }

    async def probe(self) -> tuple[bool, str]:
        """A real one-token generation that does not queue behind user work.

        Fails while draining: the process is alive (liveness, plain ``/health``, still passes)
        but takes no new work, and a gateway that was not told of the drain should stop
        routing to it within its probe rounds, not learn it from refused requests."""
        ok, why = self.health()
        if not ok:
            return False, why
        if self.draining:
            return False, "the server is draining and takes no new requests"
        timeout = self.settings.probe_timeout_s
        t0 = self.clock()
        try:
            async with asyncio.timeout(timeout):
                ids = self.engine.tokenizer.encode("ok", add_special_tokens=False) or [0]
                request, text = self.engine.prepare(
                    ids,
                    RequestOptions(
                        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                        priority=PROBE_PRIORITY,
                        deadline=t0 + timeout,
                        is_probe=True,
                    ),
                )
                async for out in self.engine.stream(request, text):
                    if out.finished:
                        reason = out.outputs[0].finish_reason
                        if reason != "length":
                            return False, f"probe generation ended as {reason}: {out.error}"
        except TimeoutError:
            return False, f"probe generation did not finish within {timeout:g}s"
        except EngineDeadError as exc:
            return False, str(exc)
        return True, f"generated one token in {1000 * (self.clock() - t0):.0f} ms"

    # ----- requests -----
    def check_accepting(self) -> None:
        if self.injected_error_status:
            raise APIError(
                self.injected_error_status, "injected fault: this replica fails every request"
            )
        if self.draining:
            raise APIError(503, "the server is draining and takes no new requests", code="draining")
        if self.phase is not Phase.READY:
            raise APIError(503, "the model is still loading", code="loading")
        ok, why = self.health()
        if not ok:
            raise APIError(503, f"the engine is unhealthy: {why}", code="unhealthy")

    def deadline_from(self, header_ms: str | None) -> float | None:
        budget = deadline_budget_s(header_ms)
        if budget is None:
            budget = self.settings.default_timeout_s or None
        return None if budget is None else self.clock() + budget

    def terms_from(self, priority: int, headers: Mapping[str, str], continues: bool) -> Terms:
        """A request's ``Terms`` from its headers (a 400 naming one that is malformed)."""
        first = objective_s(TTFT_SLO_HEADER, headers.get(TTFT_SLO_HEADER))
        per_token = objective_s(TPOT_SLO_HEADER, headers.get(TPOT_SLO_HEADER))
        objective = None
        if first is not None or per_token is not None:
            by = None if first is None else self.clock() + first
            objective = Objective(by, per_token)
        deadline = self.deadline_from(headers.get(DEADLINE_HEADER))
        return Terms(priority, deadline, objective, continues)

    def prepare(
        self,
        prompts: list[str | list[int]],
        samplings: list[SamplingParams],
        terms: Terms,
        add_special_tokens: bool = True,
        resume: Resume | None = None,
    ) -> list[Prepared]:
        """Validate and tokenize every engine request of one HTTP request; nothing is queued."""
        out = []
        try:
            for prompt, sampling in zip(prompts, samplings, strict=True):
                request, text = self.engine.prepare(
                    prompt,
                    RequestOptions(
                        sampling,
                        priority=terms.priority,
                        deadline=terms.deadline,
                        add_special_tokens=add_special_tokens,
                        resume=resume,
                    ),
                )
                out.append(Prepared(request, text))
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="unhealthy") from exc
        return out

    def admit(self, group: list[Prepared], terms: Terms, continuation: bool = False) -> None:
        """Admit the whole group or raise 429; sheds lower-priority waiting work if it must.
        A continuation (a resumed stream) skips the predicted-wait bounds and its objective
        (its client has its first token), not the queue's bounds."""
        priority = terms.priority
        forecast = self.engine.stats.forecast
        requests = [p.request for p in group]
        needs = [
            Need(
                forecast.footprint_blocks(r.num_prompt_tokens, r.max_tokens, r.runs_to_max_tokens),
                forecast.run_s(r.max_tokens, r.runs_to_max_tokens),
                r.runs_to_max_tokens,
            )
            for r in requests
        ]
        decision = self.admission.admit(
            [r.request_id for r in requests],
            [r.num_prompt_tokens for r in requests],
            priority,
            terms.deadline,
            continuation,
            needs,
            terms.objective,
        )
        if not decision.admitted:
            reason = decision.reason or "overloaded"
            self.metrics.reject(reason)
            headers = {"Retry-After": str(int(decision.retry_after_s))}
            if decision.sheds_priority:
                headers[SHEDDING_HEADER] = str(priority)
                if self.admission.patient_s is not None:  # spared: held to their objective
                    headers[SPARES_HEADER] = str(round(1000 * self.admission.patient_s))
            run_s = max((n.hold_s for n in needs if n.exact), default=0.0)
            message = self._refusal_message(reason, decision.predicted_wait_s, terms, run_s)
            if decision.large:
                message = (
                    "the server is overloaded, and this request wants more than twice the KV "
                    "cache of the typical one: under load the largest requests are refused first"
                )
            raise APIError(429, message, code=reason, headers=headers)
        for key in decision.shed:
            self.metrics.reject("shed")
            victim = self.inflight.get(key)
            if victim is not None:
                victim.override = APIError(
                    429,
                    "shed from the queue to make room for higher-priority work",
                    code="shed",
                    headers={"Retry-After": "1"},
                )
            self.engine.abort(key)

    def _refusal_message(self, reason: str, wait: float, terms: Terms, run_s: float) -> str:
        waiting, priority, objective = len(self.admission.waiting), terms.priority, terms.objective
        if reason == "slo_ttft" and objective is not None and objective.first_token_by is not None:
            left = max(0.0, objective.first_token_by - self.clock())
            return (
                f"the request's first token is predicted in {wait:.2f}s behind {waiting} "
                f"waiting, later than its {TTFT_SLO_HEADER} allows ({left:.2f}s)"
            )
        if reason == "slo_tpot" and objective is not None and objective.per_token_s is not None:
            step = self.engine.stats.forecast.busy_step_s
            return (
                f"tokens come every {1000 * step:.0f} ms here now, slower than its "
                f"{TPOT_SLO_HEADER} allows ({1000 * objective.per_token_s:g} ms)"
            )
        if reason == "overloaded":
            over = self.admission.trends.filling_over(priority)
            long = over > self.admission.config.trend.interval_s
            arrived, served = self.admission.trends.counts(priority, long)
            return (
                f"the server is overloaded: {arrived} requests of priority {priority} or better "
                f"arrived and {served} started (or finished, where more did) "
                f"over the last {over:g}s, and this one would "
                f"wait {wait:.2f}s (more than {self.settings.queue_target_s:g}s) behind "
                f"{waiting} waiting"
            )
        if reason == "deadline" and run_s:
            return (
                f"the request cannot finish before its deadline: predicted to start in "
                f"{wait:.2f}s behind {waiting} waiting, and its max_tokens take about "
                f"{run_s:.2f}s more"
            )
        if reason == "deadline":
            return (
                f"the request cannot start before its deadline: predicted wait {wait:.2f}s "
                f"behind {waiting} waiting"
            )
        return f"the server's queue is full ({reason}): {waiting} requests waiting"

    async def run(self, group: list[Prepared]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every request in the group as they come, tagged with their index.

        Raises ``APIError`` as soon as any of them fails; leaving early aborts all of them.
        """
        results: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, p, results)) for i, p in enumerate(group)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await results.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(
        self,
        index: int,
        prepared: Prepared,
        results: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]],
    ) -> None:
        request = prepared.request
        key = request.request_id
        tracked = _InFlight(key, request.num_prompt_tokens, self.clock())
        self.inflight[key] = tracked
        m, model = self.metrics, self.model_name
        # The engine ends a late request at its next step; should the loop itself be stuck,
        # the client is still told at its deadline (plus a grace of a few steps).
        deadline = None if request.deadline is None else request.deadline + DEADLINE_GRACE_S
        answered = False  # ran to its end: its slot is room the queue takes (admission)
        try:
            async with asyncio.timeout_at(deadline):
                async for out in self.engine.stream(request, prepared.text):
                    now = self.clock()
                    new = len(out.outputs[0].delta_token_ids)
                    if new:
                        if tracked.first_token is None:
                            tracked.first_token = now
                            error = self.admission.started(key)
                            if error is not None:
                                m.wait_error.labels(model).observe(error)
                            m.ttft.labels(model).observe(now - tracked.arrival)
                        elif tracked.last_token is not None:
                            m.itl.labels(model).observe((now - tracked.last_token) / new)
                        tracked.last_token = now
                        m.generation_tokens.labels(model).inc(new)
                    if not out.finished:
                        results.put_nowait((index, out))
                        continue
                    reason = out.outputs[0].finish_reason or "error"
                    answered = reason in ("stop", "length")
                    m.finished(reason, tracked.prompt_tokens)
                    if prepared.report is not None:
                        prepared.report.engine_done(
                            out.arrival_time,
                            out.first_scheduled_time,
                            out.first_token_time,
                            out.finished_time,
                            len(out.outputs[0].token_ids),
                            reason,
                        )
                    if reason in ("stop", "length") and tracked.override is None:
                        m.e2e.labels(model).observe(now - tracked.arrival)
                        results.put_nowait((index, out))
                    else:
                        results.put_nowait((index, _end_error(reason, out.error, tracked.override)))
                    return
        except asyncio.CancelledError:  # the client left: the stream's exit aborts it
            m.finished("abort", tracked.prompt_tokens)
            raise
        except TimeoutError:
            m.finished("timeout", tracked.prompt_tokens)
            results.put_nowait((index, _end_error("timeout", None, tracked.override)))
        except EngineDeadError as exc:
            m.finished("error", tracked.prompt_tokens)
            results.put_nowait((index, APIError(503, str(exc), code="unhealthy")))
        except InvalidRequestError as exc:  # refused by the engine thread itself
            results.put_nowait((index, APIError(400, str(exc), param=exc.param)))
        finally:
            self.admission.left(key, answered)
            self.inflight.pop(key, None)
            results.put_nowait((index, None))

    # ----- lifecycle -----
    async def drain(self, timeout_s: float) -> int:
        """Stop taking work, let in-flight requests finish, end the rest. Returns how many."""
        self.phase = Phase.DRAINING
        log.info("draining: %d requests in flight, up to %.1fs", len(self.inflight), timeout_s)
        end = self.clock() + timeout_s
        while self.inflight and self.clock() < end:
            await asyncio.sleep(0.05)
        cut = list(self.inflight.values())
        for tracked in cut:
            tracked.override = APIError(
                503,
                f"the server shut down before this request finished (drain timeout {timeout_s:g}s)",
                code="shutdown",
            )
            self.engine.abort(tracked.key)
        end = self.clock() + 5.0
        while self.inflight and self.clock() < end:
            await asyncio.sleep(0.02)
        if cut:
            log.warning("drain timeout: ended %d unfinished requests with an error", len(cut))
        return len(cut)
