"""Sending one client request to a pool: attempts, retries, timeouts, and the stream relay.

An attempt takes a breaker permit and a backend; its outcome feeds the breaker and outlier
detection. Retries happen only while nothing has been sent to the client, never to the same
backend twice in a row when another is eligible, and at most ``max_retries`` times:
- a refusal for load (429) moves the request at once to a backend that has not refused it,
  outside the retry budget (a refusal costs next to nothing, and each backend is asked once);
- so does a connection that could not be made (refused, or not made within ``connect_s``):
  nothing reached the backend, so nothing can storm; each backend is tried so at most once, and
  when no other is left the policy below decides;
- a failure (a stream's first byte not within ``first_byte_s``, 500/502/503/504, a connection
  lost after the request went out) is retried after jittered backoff (or the backend's
  ``Retry-After``) capped by the deadline, within the gateway-wide retry budget, whose slot the
  retry holds until its attempt answers.
A whole (non-streamed) answer is bounded only by the request's deadline: it is silent until
complete, and cutting it would have another backend compute it again. A deadline that runs out
is the request's 504, not the backend's failure. A 4xx other than 429 is the client's and passes
through as it is. The remaining deadline travels with each attempt as ``X-Request-Deadline-Ms``
so that the backend drops work nobody will wait for.

That is for the completions routes, where every attempt may be repeated. A ``Call`` says how
another route goes: its method, and whether it may be sent again once a backend has received it;
one that may not is retried only when no connection was made, and otherwise the backend's answer
(a 5xx, a 429) is the client's and a failure after sending is a 502.

A stream is committed once its first chunk has arrived: the client's 200 and headers are sent
only then, so a backend that fails before producing anything is retried invisibly. What happens
after that is ``stream``'s business.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
from opentelemetry import trace

from poise.gateway.outcome import CutOff, Outcome
from poise.gateway.pool import Backend, Pool
from poise.gateway.prefix import Affinity
from poise.gateway.upstream import (
    Upstream,
    error_code,
    error_message,
    output_tokens,
    passed_headers,
    retry_after_s,
)
from poise.observability.tracing import Tracing
from poise.protocol import (
    DEADLINE_HEADER,
    SHEDDING_HEADER,
    SPARES_HEADER,
    TPOT_SLO_HEADER,
    TTFT_SLO_HEADER,
    APIError,
    objective_s,
)
from poise.resilience.breaker import Permit
from poise.resilience.retry import RetryBudget, RetryPolicy

log = logging.getLogger("poise.gateway")

# 500 too, as Envoy's ``5xx``: generation has no side effects, and nothing was sent yet.
# A request body made for one backend; None: that backend cannot serve the request.
BodyFor = Callable[[Backend], bytes | None]

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
# A poise replica's error codes for "not serving now" (draining after SIGTERM, loading): its
# health checks take it out; they are not the error answers that draw attempts to it
# (``Pool._rather``).
NOT_SERVING_CODES = frozenset({"draining", "loading"})
# A poise replica that says it sheds a priority (``SHEDDING_HEADER`` on its 429) refuses it and
# worse for now: the gateway refuses them itself for SHED_HOLD_S rather than forward a flood
# only to carry its refusals back (see ``admission.PoolGate``).
SHED_HOLD_S = 0.25
# On the headers the gateway forwards (a client's ``x-poise-`` headers are never passed on):
# when, on the gateway's clock, the request's first token is due by its ``x-slo-ttft-ms``,
# counted from when the gateway received it. Each attempt sends the backend what is left of
# it, so that time in the gateway's line and on a backend that refused it counts.
FIRST_TOKEN_BY = "x-poise-first-token-by"
FAILURE_STATUS = frozenset({500, 502, 503, 504})  # what counts against a backend's health
# How long a broken stream waits for a backend other than the one it broke on to be eligible
# (one marked down for a slow probe coming back, a restarted replica), and how often it looks.
RESUME_WAIT_S = 3.0
RESUME_LOOK_S = 0.1


def objective_headers(client: Mapping[str, str], now: float) -> dict[str, str]:
    """What the gateway forwards of a request's latency objective (``x-slo-ttft-ms``,
    ``x-slo-tpot-ms``; a 400 naming one that is malformed): the first as ``FIRST_TOKEN_BY``."""
    out = {}
    first = objective_s(TTFT_SLO_HEADER, client.get(TTFT_SLO_HEADER))
    if first is not None:
        out[FIRST_TOKEN_BY] = repr(now + first)
    per_token = client.get(TPOT_SLO_HEADER)
    if objective_s(TPOT_SLO_HEADER, per_token) is not None:
        assert per_token is not None
        out[TPOT_SLO_HEADER] = per_token
    return out


def first_token_due(objective: Mapping[str, str]) -> float | None:
    """When the first token is due by the objective ``objective_headers`` made (None: none)."""
    due = objective.get(FIRST_TOKEN_BY)
    return None if due is None else float(due)


@dataclass(slots=True)
class Attempt:
    """A request's journey: which backends, how it ended; for metrics and the response."""

    tried: list[Backend] = field(default_factory=list)
    retries: int = 0
    last_error: str | None = None
    overloaded: bool = False  # the last attempt was refused for load (429)
    cut_off: bool = False  # the last attempt was moved off a backend found dead
    # Backends no connection could be made to (nothing reached them): the request moves on at
    # once, outside the retry budget (it carried nothing: no storm), never back to one of them.
    unreachable: list[Backend] = field(default_factory=list)
    moving: bool = False  # the next pick is such a move
    unable: frozenset[Backend] = frozenset()  # the backends the request's body is not for
    holds_retry: bool = False  # a retry slot of the budget, until the retried attempt answers
    span: trace.Span | None = None  # the request's span: each attempt is a child of it
    priority: int | None = None  # the one it is sent with (``x-priority``): what routing weighs


@dataclass(frozen=True, slots=True)
class Call:
    """How a request goes to a backend besides its path and body. The defaults are the
    completions routes'; a passthrough route (``passthrough``) sets its own."""

    method: str = "POST"
    # May be sent again once a backend has received it (after a 5xx, a 429, a timeout, a
    # dropped connection, a cut-off): generation and other pure computation, never a call
    # that may have changed state. One that may not is sent again only when it never left
    # (the connection was refused or could not be made), and a backend's answer, whatever
    # its status, is the client's.
    idempotent: bool = True
    rename: bool = True  # the body is JSON naming the model, renamed for a backend's own name
    # A 200 is relayed as a stream when its Content-Type says text/event-stream; when False,
    # when the request asked for one (``stream``).
    stream_by_type: bool = False


COMPLETION = Call()


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float
    first_byte_s: float


class Forwarder:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        policy: RetryPolicy,
        budget: RetryBudget,
        timeouts: Timeouts,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        on_outcome: Callable[[Backend, str, bool, str], None] | None = None,
        on_sent: Callable[[str, bool], None] = lambda model, routed: None,
        on_budget_exhausted: Callable[[], None] = lambda: None,
        tracing: Tracing | None = None,
    ) -> None:
        self.session = session
        self.policy = policy
        self.budget = budget
        self.timeouts = timeouts
        self.clock = clock
        self.rng = rng or random.Random()
        self.on_outcome = on_outcome or (lambda backend, outcome, first, recovery: None)
        self.on_sent = on_sent  # a request sent to a pool: did it find a backend
        self.on_budget_exhausted = on_budget_exhausted
        self.tracer = tracing.tracer if tracing is not None else None

    async def send(
        self,
        pool: Pool,
        path: str,
        body: bytes | BodyFor,
        headers: dict[str, str],
        deadline: float,
        stream: bool,
        affinity: Affinity | None,
        journey: Attempt,
        call: Call = COMPLETION,
    ) -> Upstream:
        """The first acceptable upstream response, or an APIError saying why there is none.

        ``body``: the same for every backend, or made for each (the engine's own way to ask
        for usage, or to continue a stream); a backend it makes none for is never chosen."""
        bodies: dict[Backend, bytes | None] = {}

        def body_of(b: Backend) -> bytes | None:
            if isinstance(body, bytes):
                return body
            if b not in bodies:
                bodies[b] = body(b)
            return bodies[b]

        fresh = not journey.tried  # not a resumed stream's, which begins with the broken one
        journey.priority = priority = priority_sent(headers)
        try:
            while True:
                # After a refusal for load, none of those that refused; otherwise not the last one.
                tried = journey.tried if journey.overloaded else journey.tried[-1:]
                unable = journey.unable = frozenset(b for b in pool.backends if body_of(b) is None)
                if journey.moving:  # a move goes only where a connection may yet be made
                    journey.moving = False
                    unable |= frozenset(journey.unreachable)
                backend = pool.pick(
                    affinity, frozenset(tried) | set(journey.unreachable), unable, priority
                )
                permit = backend.breaker.acquire() if backend is not None else None
                if fresh:
                    fresh = False
                    self.on_sent(pool.model, permit is not None)
                if backend is None or permit is None:
                    why = f" (last error: {journey.last_error})" if journey.last_error else ""
                    raise APIError(
                        503, f"no healthy backend for model {pool.model!r}{why}", code="no_backend"
                    )
                journey.tried.append(backend)
                left = deadline - self.clock()
                if left <= 0:
                    backend.breaker.release(permit)
                    raise APIError(
                        504, "the request's deadline passed at the gateway", code="timeout"
                    )
                payload = body_of(backend)
                assert payload is not None  # pick never chooses an unable backend
                upstream, retry_after = await self._attempt(
                    pool, backend, permit, path, payload, headers, left, stream, journey, call
                )
                self._retry_answered(journey)
                if upstream is not None:
                    return upstream
                if journey.cut_off:
                    # Moved off a backend the health checks found dead: at once, and neither a
                    # retry of the policy's nor the budget's (no storm: one move per attempt cut).
                    # Not a call that the dead backend may have acted on.
                    journey.cut_off = False
                    if not call.idempotent:
                        raise _give_up(journey)
                    continue
                if journey.unreachable and journey.unreachable[-1] is backend:
                    # No connection was made: nothing was sent. Another backend at once, outside
                    # the budget, never one already found unreachable; when none is left, the
                    # policy decides.
                    left = deadline - self.clock()
                    if self._reachable(pool, journey) and left >= self.policy.min_attempt_s:
                        journey.retries += 1  # an attempt after a failure, as a 429's move
                        journey.moving = True
                        continue
                # Not acceptable and nothing sent yet: retry if policy, deadline and budget allow.
                if journey.overloaded:
                    # A backend that refused for load said so at once, so that the request can go
                    # to another now. When every backend has refused, the client hears it now too,
                    # with Retry-After: waiting here would only spend its time-to-first-token.
                    untried = [b for b in pool.eligible() if b not in journey.tried]
                    if not untried:
                        raise _give_up(journey, retry_after)
                delay = self.policy.delay_s(
                    journey.retries,
                    self.rng,
                    None if journey.overloaded else retry_after,
                    deadline - self.clock(),
                )
                if delay is None:
                    raise _give_up(journey, retry_after)
                journey.retries += 1
                if journey.overloaded:
                    # To another backend, which has not refused: no backoff owed, and no share of
                    # the budget. A refusal costs its backend next to nothing, and a request is
                    # never sent back to one that refused it, so moves cannot become a storm.
                    continue
                if not self.budget.try_retry():
                    journey.retries -= 1
                    self.on_budget_exhausted()
                    raise _give_up(journey, retry_after)
                journey.holds_retry = True
                await asyncio.sleep(delay)
        finally:
            self._retry_answered(journey)

    @staticmethod
    def _reachable(pool: Pool, journey: Attempt) -> list[Backend]:
        """The eligible backends a move may go to: none found unreachable, each able to take the
        request's body."""
        gone = journey.unable | set(journey.unreachable)
        return [b for b in pool.eligible() if b not in gone]

    async def wait_for_another(self, pool: Pool, failed: Backend, deadline: float) -> None:
        """Returns once a backend other than ``failed`` passes every check (``Pool.trusted``),
        or after ``RESUME_WAIT_S`` (or at the deadline). A stream the client is receiving would
        otherwise go back to the backend it just broke on, or to one in the panic set, or end in
        an error, while another is a moment from taking it (a busy one marked down for a slow
        probe, a restarted replica): a pause in the stream costs the client less than its end."""
        if not any(b is not failed and not b.retired for b in pool.backends):
            return  # nothing else to wait for
        for _ in range(round(RESUME_WAIT_S / RESUME_LOOK_S)):
            if self.clock() >= deadline or any(
                b is not failed and pool.trusted(b) for b in pool.backends
            ):
                return
            await asyncio.sleep(RESUME_LOOK_S)

    def _retry_answered(self, journey: Attempt) -> None:
        """The retry's attempt has its answer (or the request is over): it is no longer in
        flight."""
        if journey.holds_retry:
            journey.holds_retry = False
            self.budget.retry_ended()

    def _ran_out(self, data: bytes, started: float, left_s: float) -> bool:
        """Whether a backend's 504 is the request's deadline passing there: it says so, or too
        little of the deadline is left for another attempt."""
        left = left_s - (self.clock() - started)
        return error_code(data) == "timeout" or left < self.policy.min_attempt_s

    async def _attempt(
        self,
        pool: Pool,
        backend: Backend,
        permit: Permit,
        path: str,
        body: bytes,
        headers: dict[str, str],
        left_s: float,
        stream: bool,
        journey: Attempt,
        call: Call,
    ) -> tuple[Upstream | None, float | None]:
        """(upstream, None) when acceptable; (None, retry_after) when worth retrying."""
        journey.overloaded = False
        if backend.settings.model is not None and call.rename:
            body = _renamed(body, backend.settings.model)
        sent_headers = {**headers, DEADLINE_HEADER: str(max(1, int(left_s * 1000)))}
        due = sent_headers.pop(FIRST_TOKEN_BY, None)
        if due is not None:
            first_left_s = float(due) - self.clock()
            sent_headers[TTFT_SLO_HEADER] = str(max(1, int(first_left_s * 1000)))
        if backend.settings.api_key:
            sent_headers["authorization"] = f"Bearer {backend.settings.api_key}"
        t = self.timeouts
        # A stream's first byte is its first token: first_byte_s bounds that silence (and the
        # relay's stream_idle_s the later ones). A whole answer is silent until it is complete,
        # however healthy its backend, so only the request's deadline bounds it: cutting it
        # would throw away work the backend accepted and make another compute it again.
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=min(t.connect_s, left_s),
            sock_read=min(t.first_byte_s, left_s) if stream else left_s,
        )
        span = None
        if self.tracer is not None and journey.span is not None:
            span = self.tracer.start_span(
                "gateway upstream attempt",
                context=trace.set_span_in_context(journey.span),
                kind=trace.SpanKind.CLIENT,
                attributes={
                    "poise.retry": journey.retries,
                    "poise.backend": backend.url,
                    "server.address": backend.url,
                    "url.path": path,
                },
            )
            Tracing.inject(sent_headers, span)
        started = self.clock()
        priority = journey.priority
        # A stream's first token and the gaps after it time the backend for routing (a stream
        # of typical size: ``LatencyConfig.large_factor``); a whole answer's duration says
        # more about its length than about the backend. One that a better priority outranks
        # times nothing: its waits are its rank's (``Pool.outranked``).
        outranked = pool.outranked(backend, priority)
        backend.attempt_started(priority)
        timer = pool.latency.stream(backend.url, len(body), outranked) if stream else None
        # A resumed stream's journey begins with the backend it broke on: not a first pick.
        first = len(journey.tried) == 1 and journey.retries == 0
        outcome = Outcome(
            self.clock, self.on_outcome, pool, backend, permit, started, span, timer, first,
            priority,
        )  # fmt: skip
        response: aiohttp.ClientResponse | None = None
        cut = CutOff(asyncio.current_task())
        backend.movable[cut] = cut.fire
        try:
            async with asyncio.timeout(left_s):
                response = await self.session.request(
                    call.method,
                    backend.url + path,
                    data=body or None,
                    headers=sent_headers,
                    timeout=timeout,
                    # A body sent without a type goes without one, as it came.
                    skip_auto_headers=None if "content-type" in headers else ("Content-Type",),
                )
                status = response.status
                streams = stream
                if call.stream_by_type:
                    streams = response.content_type == "text/event-stream"
                if status != 200 or not streams:
                    data = await response.read()
                    cut.armed = False
                    response.release()
                    journey.overloaded = status == 429 and call.idempotent
                    if status == 504 and self._ran_out(data, started, left_s):
                        # The backend kept the request to its deadline (a poise replica
                        # honours the deadline header and says so): the request's 504.
                        outcome.done("deadline")
                        raise APIError(504, f"{backend.url}: {error_message(data)}", code="timeout")
                    # A replica that says it is draining or still loading is not answering
                    # with errors: routing must not send it more to find out.
                    answered = error_code(data) not in NOT_SERVING_CODES
                    shedding = response.headers.get(SHEDDING_HEADER) if status == 429 else None
                    if shedding is not None:
                        spares = _spares_s(response.headers.get(SPARES_HEADER))
                        now = self.clock()
                        backend.note_shedding(_priority(shedding), now, SHED_HOLD_S, spares)
                    if status in RETRYABLE_STATUS and call.idempotent:
                        verdict = "overloaded" if status == 429 else "error"
                        recovery = "move" if status == 429 else "retry"
                        outcome.done(verdict, answered=answered, recovery=recovery)
                        journey.last_error = f"{status} from {backend.url}: {error_message(data)}"
                        return None, retry_after_s(response)
                    verdict = "overloaded" if status == 429 else "ok" if status < 500 else "error"
                    outcome.done(verdict, output_tokens(data), answered=answered, recovery="none")
                    return Upstream(status, passed_headers(response), data, backend=backend), None
                chunks = response.content.iter_any()
                first = await anext(chunks, b"")
                if timer is not None:
                    timer.read_ended()
                cut.armed = False
                if not first:
                    raise aiohttp.ServerDisconnectedError("the stream ended before its first chunk")
                return (
                    Upstream(
                        200,
                        passed_headers(response),
                        None,
                        first,
                        chunks,
                        response,
                        backend,
                        outcome,
                    ),
                    None,
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            if response is not None:
                response.close()
            if isinstance(exc, TimeoutError) and self.clock() - started >= left_s - 0.001:
                # The request's time ran out, not the backend's: no verdict on it, no retry.
                outcome.done("deadline")
                raise APIError(
                    504,
                    f"the request's deadline passed while {backend.url} computed it",
                    code="timeout",
                ) from None
            never_sent = _never_sent(exc)
            given_up = not call.idempotent and not never_sent
            if never_sent:
                journey.unreachable.append(backend)
            # A move where another backend may take it (send decides, the deadline in hand),
            # else the policy's retry.
            moves = never_sent and bool(self._reachable(pool, journey))
            outcome.done(
                "timeout" if isinstance(exc, TimeoutError) else "connect_error",
                recovery="none" if given_up else "move" if moves else "retry",
            )
            journey.last_error = f"{type(exc).__name__} from {backend.url}: {exc}"
            if given_up:
                raise _give_up(journey) from None
            return None, None
        except asyncio.CancelledError:
            if response is not None:
                response.close()
            if not cut.fired or cut.task is None or cut.task.uncancel() > 0:
                outcome.abandon()  # the client left: no verdict on the backend
                raise
            # Cut off: the health checks found the backend dead while this waited on it.
            journey.cut_off = True
            outcome.done("timeout", recovery="move" if call.idempotent else "none")
            journey.last_error = f"{backend.url} stopped answering its health checks"
            return None, None
        except BaseException:
            if response is not None:
                response.close()
            outcome.abandon()
            raise
        finally:
            cut.armed = False
            backend.movable.pop(cut, None)


def _give_up(journey: Attempt, retry_after: float | None = None) -> APIError:
    why = journey.last_error or "the backends failed"
    if journey.overloaded:
        wait = max(1, math.ceil(retry_after or 1.0))  # the backend's own advice, if it gave one
        return APIError(
            429,
            f"every backend is overloaded ({why})",
            code="overloaded",
            headers={"Retry-After": str(wait)},
        )
    return APIError(
        502,
        f"upstream failed after {len(journey.tried)} attempt(s): {why}",
        code="upstream_error",
    )


def priority_sent(headers: dict[str, str]) -> int | None:
    """The priority the gateway sends with a request (``x-priority``); None: none, or not a
    number (its attempts then count against every priority's routing)."""
    value = headers.get("x-priority")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _priority(value: str) -> int:
    """A priority a backend named; one it garbled sheds nothing (the worst there is)."""
    try:
        return int(value)
    except ValueError:
        return 2**31


def _spares_s(value: str | None) -> float | None:
    """The first-token objective a shedding backend spares, in seconds (None: none said, or
    garbled: it spares nothing)."""
    try:
        return None if value is None else float(value) / 1000.0
    except ValueError:
        return None


def _never_sent(exc: BaseException) -> bool:
    """No connection was made: the backend cannot have seen the request."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def _renamed(body: bytes, model: str) -> bytes:
    """The body with the model under the name the backend knows it by."""
    return json.dumps({**json.loads(body), "model": model}).encode()
