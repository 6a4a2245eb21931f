"""The forwarder against real HTTP backends on loopback: a refusal for load moves the request to
another backend at once, refusals everywhere reach the client at once, and an attempt waiting on
a backend that the health checks find dead moves elsewhere instead of waiting for it."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from poise.gateway.config import GatewaySettings
from poise.gateway.forward import FIRST_TOKEN_BY, Attempt, Forwarder, Timeouts
from poise.gateway.pool import Pool
from poise.gateway.stream import relay
from poise.protocol import APIError
from poise.resilience.breaker import BreakerState
from poise.resilience.retry import RetryBudget, RetryPolicy

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def refuse(request: web.Request) -> web.Response:
    return web.json_response(
        {"error": {"message": "overloaded"}}, status=429, headers={"Retry-After": "3"}
    )


async def answer(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"text": "ok"}]})


class Hang:
    """Accepts the request and never answers, as a SIGSTOPped process."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()

    async def handler(self, request: web.Request) -> web.Response:
        self.arrived.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


async def serve(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # a hung handler is not waited for
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def backends() -> AsyncIterator[Callable[..., Awaitable[tuple[Pool, Forwarder]]]]:
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def make(
        *handlers: Handler, first_byte_s: float = 60.0, **gateway: Any
    ) -> tuple[Pool, Forwarder]:
        urls = []
        for h in handlers:
            runner, url = await serve(h)
            runners.append(runner)
            urls.append(url)
        settings = GatewaySettings.model_validate(
            {"models": {"m": {"backends": [{"url": u} for u in urls]}}, **gateway}
        )
        pool = Pool("m", settings, time.monotonic, random.Random(0))
        session = aiohttp.ClientSession()
        sessions.append(session)
        # Backoff that would show: a retry that slept would take 0.5 s or more.
        policy = RetryPolicy(max_retries=2, base_s=0.5, cap_s=1.0)
        fwd = Forwarder(session, policy, RetryBudget(), Timeouts(2.0, first_byte_s))
        return pool, fwd

    yield make
    for s in sessions:
        await s.close()
    for r in runners:
        await r.cleanup()


async def send(
    pool: Pool,
    fwd: Forwarder,
    journey: Attempt | None = None,
    stream: bool = False,
    deadline_s: float = 30.0,
):
    return await fwd.send(
        pool,
        "/v1/completions",
        b'{"model": "m", "prompt": "x"}',
        {"content-type": "application/json"},
        time.monotonic() + deadline_s,
        stream,
        None,
        journey or Attempt(),
    )


async def test_a_refusal_for_load_goes_to_another_backend_without_backoff(backends):
    pool, fwd = await backends(refuse, answer)
    for _ in range(6):  # whichever is picked first
        t0 = time.perf_counter()
        journey = Attempt()
        up = await send(pool, fwd, journey)
        assert up.status == 200 and up.backend is pool.backends[1]
        assert time.perf_counter() - t0 < 0.3
    # A refusal for load is not a failure of the backend.
    assert pool.backends[0].breaker.allows() and not pool.outliers.is_ejected(pool.backends[0].url)


async def test_refused_everywhere_the_client_hears_it_at_once_with_retry_after(backends):
    pool, fwd = await backends(refuse, refuse)
    t0 = time.perf_counter()
    with pytest.raises(APIError) as err:
        await send(pool, fwd)
    assert time.perf_counter() - t0 < 0.3  # not held for the backends' Retry-After
    assert err.value.status == 429
    assert err.value.headers == {"Retry-After": "3"}


async def test_an_attempt_waiting_on_a_backend_found_dead_moves_elsewhere(backends):
    hang = Hang()
    pool, fwd = await backends(hang.handler, answer)
    stuck, good = pool.backends
    good.healthy = False  # so the first attempt goes to the one that will hang
    task = asyncio.create_task(send(pool, fwd))
    await asyncio.wait_for(hang.arrived.wait(), 5)
    assert stuck.inflight == 1 and len(stuck.movable) == 1
    good.healthy = True
    stuck.healthy = False
    t0 = time.perf_counter()
    assert stuck.cut_off() == 1  # what the health loop does when it marks the backend down
    up = await asyncio.wait_for(task, 5)
    assert up.status == 200 and up.backend is good
    assert time.perf_counter() - t0 < 1.0
    assert stuck.inflight == 0 and not stuck.movable
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]


async def test_a_client_that_leaves_is_still_a_cancellation(backends):
    hang = Hang()
    pool, fwd = await backends(hang.handler)
    (stuck,) = pool.backends
    task = asyncio.create_task(send(pool, fwd))
    await asyncio.wait_for(hang.arrived.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stuck.inflight == 0 and not stuck.movable
    assert stuck.breaker.allows()  # no verdict on the backend: the client left
    assert stuck.cut_off() == 0


async def test_moving_work_off_a_dead_backend_is_not_charged_to_the_retry_budget(backends):
    hang = Hang()
    pool, fwd = await backends(hang.handler, answer)
    stuck, good = pool.backends
    good.healthy = False
    fwd.budget = RetryBudget(ratio=0.0, min_concurrent=0)  # no retry at all may run
    tasks = [asyncio.create_task(send(pool, fwd)) for _ in range(5)]
    await asyncio.wait_for(hang.arrived.wait(), 5)
    while stuck.inflight < 5:
        await asyncio.sleep(0.01)
    good.healthy, stuck.healthy = True, False
    assert stuck.cut_off() == 5
    ups = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert all(u.status == 200 and u.backend is good for u in ups)
    assert fwd.budget.refused_total == 0


async def test_a_refusal_for_load_is_never_sent_back_to_a_backend_that_refused(backends):
    calls: list[str] = []

    def counting(name: str, handler: Handler) -> Handler:
        async def h(request: web.Request) -> web.StreamResponse:
            calls.append(name)
            return await handler(request)

        return h

    pool, fwd = await backends(counting("a", refuse), counting("b", refuse), counting("c", answer))
    fwd.policy = RetryPolicy(max_retries=2, base_s=0.5, cap_s=1.0)
    for _ in range(10):
        calls.clear()
        up = await send(pool, fwd)
        assert up.status == 200 and calls[-1] == "c"
        assert len(calls) == len(set(calls))  # each backend asked at most once


def counted(calls: list[str], name: str, handler: Handler) -> Handler:
    async def h(request: web.Request) -> web.StreamResponse:
        calls.append(name)
        return await handler(request)

    return h


async def test_a_whole_answer_longer_than_first_byte_s_is_neither_cut_nor_sent_twice(backends):
    """A non-streamed answer is silent until complete: first_byte_s does not bound it."""
    calls: list[str] = []

    async def long_answer(request: web.Request) -> web.Response:
        await asyncio.sleep(0.6)  # computing a long completion
        return web.json_response({"choices": [{"text": "x" * 100}], "usage": {
            "prompt_tokens": 1, "completion_tokens": 100, "total_tokens": 101}})  # fmt: skip

    pool, fwd = await backends(
        counted(calls, "a", long_answer), counted(calls, "b", long_answer), first_byte_s=0.2
    )
    up = await send(pool, fwd)
    assert up.status == 200 and len(calls) == 1  # computed once, by one backend
    assert all(b.breaker.allows() and b.inflight == 0 for b in pool.backends)


async def test_long_generations_do_not_open_the_breaker_but_silent_backends_do(backends):
    """Every call is several times slow_call_s long; only the silent ones are slow calls."""

    async def long_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(15):  # 15 tokens 20 ms apart: 0.3 s, never silent for 0.2 s
            await resp.write(b'data: {"choices": [{"text": "t"}]}\n\n')
            await asyncio.sleep(0.02)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def whole(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)  # 100 tokens in 0.3 s
        return web.json_response({"usage": {"completion_tokens": 100}})

    breaker = {"slow_call_s": 0.2, "slow_token_s": 0.05, "slow_call_rate": 0.5, "min_calls": 3}
    pool, fwd = await backends(long_stream, breaker=breaker)
    (b,) = pool.backends
    for _ in range(3):
        up = await send(pool, fwd, stream=True)
        async for _chunk in relay(up, 5.0):
            pass
    pool2, fwd2 = await backends(whole, breaker=breaker)
    for _ in range(3):
        assert (await send(pool2, fwd2)).status == 200
    assert b.breaker.state is BreakerState.CLOSED
    assert pool2.backends[0].breaker.state is BreakerState.CLOSED

    async def silent_first(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.3)  # longer than slow_call_s before the first byte
        return await long_stream(request)

    pool3, fwd3 = await backends(silent_first, breaker=breaker)
    for _ in range(3):
        up = await send(pool3, fwd3, stream=True)
        async for _chunk in relay(up, 5.0):
            pass
    assert pool3.backends[0].breaker.state is BreakerState.OPEN


async def test_the_retry_budget_bounds_the_calls_on_backends_that_fail_everything(backends):
    """Backend calls <= (1 + ratio) x requests, however many requests fail at once."""
    calls: list[str] = []

    async def fail(request: web.Request) -> web.Response:
        await asyncio.sleep(0.005)
        return web.json_response({"error": {"message": "boom"}}, status=500)

    # Neither the breaker nor outlier detection takes them out: only the budget bounds calls.
    pool, fwd = await backends(
        counted(calls, "a", fail),
        counted(calls, "b", fail),
        breaker={"min_calls": 1000, "window_size": 1000},
        ejection={"consecutive_failures": 1000},
    )
    fwd.policy = RetryPolicy(max_retries=2, base_s=0.0, cap_s=0.0)
    fwd.budget = RetryBudget()  # the gateway's defaults: 20 %, floors of 3 and 1 a second

    async def request() -> int:
        fwd.budget.request_started()
        try:
            await send(pool, fwd)
        except APIError as exc:
            return exc.status
        finally:
            fwd.budget.request_ended()
        return 200

    statuses: list[int] = []
    for _ in range(4):  # a few at a time: 100 requests
        statuses += await asyncio.gather(*(request() for _ in range(25)))
    assert statuses == [502] * 100
    assert len(calls) <= 1.2 * 100, len(calls)  # without the budget: 300
    for _ in range(9):  # then waves of 100 at once: 1,000 requests in all
        statuses += await asyncio.gather(*(request() for _ in range(100)))
    assert statuses == [502] * 1000
    assert len(calls) <= 1.2 * 1000, len(calls)  # without the budget: 3,000
    assert fwd.budget.active_retries == 0


async def test_a_backend_answering_500_to_everything_is_ejected_under_the_defaults(backends):
    """Requests one at a time (the other backend idle each time), and the failing one's last
    good answers slower than the other's: its failures are retried on the other, and it is
    ejected after ``consecutive_failures`` (5) of them rather than left in rotation because
    its old latency cost keeps requests off it."""
    calls: list[str] = []

    async def fail(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "injected"}}, status=500)

    pool, fwd = await backends(counted(calls, "bad", fail), counted(calls, "good", answer))
    fwd.policy = RetryPolicy(max_retries=2, base_s=0.0, cap_s=0.0)
    bad, good = pool.backends
    for backend, ttft, tpot in ((bad, 0.03, 0.04), (good, 0.02, 0.015)):
        pool.latency.observe_ttft(backend.url, ttft)
        pool.latency.observe_tpot(backend.url, tpot)
    assert pool.latency.cost(bad.url) > pool.latency.cost(good.url)
    good.inflight += 1  # busy: the one time bad's cost does not keep the request off it
    up = await send(pool, fwd)
    assert up.status == 200 and up.backend is good and calls == ["bad", "good"]
    good.inflight -= 1
    for _ in range(10):  # each with the other idle
        up = await send(pool, fwd)
        assert up.status == 200 and up.backend is good
    assert pool.outliers.is_ejected(bad.url)
    assert calls.count("bad") == 5 and calls[:10] == ["bad", "good"] * 5


async def test_a_replica_saying_it_drains_draws_no_attempts_to_itself(backends):
    """A 503 that says "draining" (or "loading") is a replica not serving now, not one
    answering with errors: it is not preferred to hasten an ejection."""
    calls: list[str] = []

    async def draining(request: web.Request) -> web.Response:
        body = {"error": {"message": "the server is draining", "code": "draining"}}
        return web.json_response(body, status=503)

    pool, fwd = await backends(counted(calls, "draining", draining), counted(calls, "good", answer))
    fwd.policy = RetryPolicy(max_retries=2, base_s=0.0, cap_s=0.0)
    leaving, good = pool.backends
    for _ in range(6):
        up = await send(pool, fwd)
        assert up.status == 200 and up.backend is good
        assert leaving.error_answers == 0


async def test_a_stream_from_another_engine_that_ends_without_done_ends_with_an_error(backends):
    async def cut_short(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "half an"}]}\n\n')
        return resp  # the connection ends cleanly, without [DONE]

    pool, fwd = await backends(cut_short)
    up = await send(pool, fwd, stream=True)
    out = b"".join([c async for c in relay(up, 5.0)])
    assert out.startswith(b'data: {"choices": [{"text": "half an"}]}')
    assert b'"error"' in out and out.endswith(b"data: [DONE]\n\n")


SLOW = {"slow_call_s": 0.2, "slow_token_s": 0.05, "slow_call_rate": 0.5, "min_calls": 3}


async def test_a_deadline_that_runs_out_is_a_504_and_a_slow_call_not_a_failure(backends):
    """Silent to the deadline: the client hears 504 (not 502), no retry runs, the backend is
    not failed, yet a backend that hangs every call is judged slow and taken out."""
    calls: list[str] = []
    hang = Hang()
    pool, fwd = await backends(counted(calls, "a", hang.handler), breaker=SLOW)
    (b,) = pool.backends
    for _ in range(3):
        with pytest.raises(APIError) as err:
            await send(pool, fwd, deadline_s=0.3)
        assert err.value.status == 504
    assert len(calls) == 3  # one attempt each: nothing left to retry in
    assert b.inflight == 0 and not pool.outliers.is_ejected(b.url)
    assert b.breaker.state is BreakerState.OPEN  # three slow calls of three


async def test_a_backends_own_deadline_504_is_passed_on_as_the_requests(backends):
    async def timed_out(request: web.Request) -> web.Response:
        body = {"error": {"message": "the request's deadline passed", "code": "timeout"}}
        return web.json_response(body, status=504)

    calls: list[str] = []
    pool, fwd = await backends(counted(calls, "a", timed_out), counted(calls, "b", answer))
    a, b = pool.backends
    b.healthy = False  # so that the attempt goes to the one that times out
    for _ in range(3):
        with pytest.raises(APIError) as err:
            await send(pool, fwd)
        assert err.value.status == 504 and err.value.code == "timeout"
    assert calls == ["a"] * 3  # not retried: its time is up
    assert a.breaker.allows() and not pool.outliers.is_ejected(a.url)


async def test_a_slow_reader_does_not_make_its_backend_slow(backends):
    """The relay waits on the client between reads: that time is not the backend's."""

    async def fast_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(5):
            await resp.write(b'data: {"choices": [{"text": "t"}]}\n\n')
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def whole_without_usage(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)  # longer than slow_call_s; how many tokens, it does not say
        return web.json_response({"choices": [{"text": "x" * 500}]})

    pool, fwd = await backends(fast_stream, breaker=SLOW)
    for _ in range(3):
        up = await send(pool, fwd, stream=True)
        async for _chunk in relay(up, 5.0):
            await asyncio.sleep(0.3)  # the client reads slowly
    assert pool.backends[0].breaker.state is BreakerState.CLOSED
    pool2, fwd2 = await backends(whole_without_usage, breaker=SLOW)
    for _ in range(3):
        assert (await send(pool2, fwd2)).status == 200
    assert pool2.backends[0].breaker.state is BreakerState.CLOSED


async def test_each_attempt_says_whether_it_was_first_and_what_recovers_its_failure(backends):
    calls = 0

    async def flaky(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return await answer(request)

    seen: list[tuple[str, str, bool, str]] = []
    sent: list[tuple[str, bool]] = []

    def watched(fwd: Forwarder) -> None:
        fwd.on_outcome = lambda b, outcome, first, recovery: seen.append(
            (b.url, outcome, first, recovery)
        )
        fwd.on_sent = lambda model, routed: sent.append((model, routed))

    pool, fwd = await backends(flaky)
    fwd.policy = RetryPolicy(max_retries=2, base_s=0.001, cap_s=0.002)
    watched(fwd)
    assert (await send(pool, fwd)).status == 200
    url = pool.backends[0].url
    assert seen == [(url, "error", True, "retry"), (url, "ok", False, "none")]
    assert sent == [("m", True)]  # one request sent to the pool, whatever its attempts

    pool, fwd = await backends(refuse, answer)
    watched(fwd)
    seen.clear()
    while not seen or seen[0][1] != "overloaded":  # until the first pick is the one refusing
        seen.clear()
        assert (await send(pool, fwd)).status == 200
    assert seen == [
        (pool.backends[0].url, "overloaded", True, "move"),
        (pool.backends[1].url, "ok", False, "none"),
    ]
    # No backend lets a call through: the request found none to send to.
    for b in pool.backends:
        b.breaker._open()  # as a breaker tripped by failures
    with pytest.raises(APIError):
        await send(pool, fwd)
    assert sent[-1] == ("m", False)


async def shed_priority_5(request: web.Request) -> web.Response:
    """A poise replica under a flood: it refuses priority 5 and worse, whatever the size."""
    return web.json_response(
        {"error": {"message": "overloaded", "code": "overloaded"}},
        status=429,
        headers={"Retry-After": "1", "x-poise-shedding-priority": "5"},
    )


async def test_backends_that_shed_a_priority_have_its_requests_refused_at_the_gateway(backends):
    """Once every backend said it sheds priority 5 and worse, more than once, the gateway
    refuses such requests itself (nothing forwarded) for a moment; a better priority still goes
    through; a refusal that names no priority (the request's own size or deadline decided) is
    not remembered."""
    from poise.gateway.admission import PoolGate

    calls = {"n": 0}

    async def counting(request: web.Request) -> web.Response:
        calls["n"] += 1
        return await shed_priority_5(request)

    pool, fwd = await backends(counting, counting)
    gate = PoolGate(pool, GatewaySettings.model_validate({"models": {"m": {"backends": [
        {"url": b.url} for b in pool.backends]}}}).admission, time.monotonic)  # fmt: skip
    body = b'{"model": "m", "prompt": "x"}'
    for sent in (2, 4):
        with pytest.raises(APIError):
            await fwd.send(pool, "/v1/completions", body, {"x-priority": "7"},
                           time.monotonic() + 30, False, None, Attempt())  # fmt: skip
        assert calls["n"] == sent
        held_back = all(b.sheds(7, time.monotonic()) for b in pool.backends)
        assert held_back is (sent == 4)  # one refusal each is no flood yet
    with pytest.raises(APIError) as held:
        await gate.enter(9, time.monotonic() + 30)
    assert held.value.status == 429 and held.value.headers["Retry-After"] == "1"
    await asyncio.wait_for(gate.enter(0, time.monotonic() + 30), 1)  # a better priority passes
    gate.leave(0)
    await asyncio.sleep(0.3)  # the memory is short: the backends are asked again
    await asyncio.wait_for(gate.enter(9, time.monotonic() + 30), 1)
    gate.leave(9)


async def test_a_refusal_that_names_no_priority_is_not_remembered(backends):
    pool, fwd = await backends(refuse, refuse)
    with pytest.raises(APIError):
        await send(pool, fwd)
    assert not any(b.sheds(0, time.monotonic()) for b in pool.backends)


async def test_a_broken_stream_waits_for_another_backend_rather_than_going_back(backends):
    """The stream broke on one backend while the other was marked down: the resume waits for the
    other to come back (a probe that was merely slow), not for its deadline, and goes there."""
    pool, fwd = await backends(answer, answer)
    broken, other = pool.backends
    other.healthy = False
    asyncio.get_running_loop().call_later(0.4, lambda: setattr(other, "healthy", True))
    t0 = time.perf_counter()
    await fwd.wait_for_another(pool, broken, time.monotonic() + 30)
    waited = time.perf_counter() - t0
    assert 0.35 < waited < 2.0  # not RESUME_WAIT_S (3 s)
    up = await send(pool, fwd, Attempt(tried=[broken]))
    assert up.status == 200 and up.backend is other


async def test_the_resume_waits_a_bounded_time_and_only_for_what_may_come(backends, monkeypatch):
    monkeypatch.setattr("poise.gateway.forward.RESUME_WAIT_S", 0.3)
    pool, fwd = await backends(answer, answer)
    broken, other = pool.backends
    other.healthy = False  # and it stays down
    t0 = time.perf_counter()
    await fwd.wait_for_another(pool, broken, time.monotonic() + 30)
    assert 0.25 < time.perf_counter() - t0 < 1.5
    # Nor past the request's deadline.
    t0 = time.perf_counter()
    await fwd.wait_for_another(pool, broken, time.monotonic() - 1)
    assert time.perf_counter() - t0 < 0.2
    # A pool with no other backend has nothing to wait for.
    alone, fwd1 = await backends(answer)
    t0 = time.perf_counter()
    await fwd1.wait_for_another(alone, alone.backends[0], time.monotonic() + 30)
    assert time.perf_counter() - t0 < 0.2


def _closed_url() -> str:
    """A loopback port nothing listens on: every connection to it is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def _pool_with_closed(handler: Handler) -> tuple[Pool, Forwarder, web.AppRunner, list]:
    runner, url = await serve(handler)
    settings = GatewaySettings.model_validate(
        {"models": {"m": {"backends": [{"url": _closed_url()}, {"url": url}]}}}
    )
    pool = Pool("m", settings, time.monotonic, random.Random(0))
    outcomes: list[tuple[str, str, str]] = []
    fwd = Forwarder(
        aiohttp.ClientSession(),
        RetryPolicy(max_retries=2, base_s=0.5, cap_s=1.0),
        RetryBudget(),
        Timeouts(2.0, 60.0),
        on_outcome=lambda b, outcome, first, recovery: outcomes.append((b.url, outcome, recovery)),
    )
    return pool, fwd, runner, outcomes


async def test_a_refused_connection_moves_to_another_backend_at_once_outside_the_budget():
    pool, fwd, runner, outcomes = await _pool_with_closed(answer)
    closed, good = pool.backends
    budget_asked: list[bool] = []
    fwd.budget.try_retry = lambda: budget_asked.append(True) or True  # type: ignore[method-assign]
    try:
        moved = 0
        for _ in range(8):  # whichever is picked first
            journey = Attempt()
            t0 = time.perf_counter()
            up = await send(pool, fwd, journey)
            assert up.status == 200 and up.backend is good
            assert time.perf_counter() - t0 < 0.4  # no backoff (0.5 s and more)
            assert journey.tried in ([good], [closed, good])
            moved += journey.tried == [closed, good]
            if journey.tried == [closed, good]:
                assert journey.retries == 1  # the attempt count tells the move from a first try
        assert moved >= 1, "the closed port was never picked first"
        assert not budget_asked, "a move is outside the retry budget"
        refused = [o for o in outcomes if o[0] == closed.url]
        assert refused and all(o[1:] == ("connect_error", "move") for o in refused)
    finally:
        await fwd.session.close()
        await runner.cleanup()


async def test_a_refused_connection_with_nowhere_to_move_is_the_policys_to_retry():
    """The other backend cannot take this body: no move (it would go back to the closed port
    at once, again and again); the policy retries, within max_retries, and gives up."""
    pool, fwd, runner, outcomes = await _pool_with_closed(answer)
    closed, good = pool.backends
    fwd.policy = RetryPolicy(max_retries=2, base_s=0.0, cap_s=0.0)
    try:
        journey = Attempt()
        with pytest.raises(APIError) as err:
            await fwd.send(
                pool,
                "/v1/completions",
                lambda b: None if b is good else b'{"model": "m", "prompt": "x"}',
                {"content-type": "application/json"},
                time.monotonic() + 30,
                False,
                None,
                journey,
            )
        assert err.value.status in (502, 503)
        assert journey.tried == [closed] * 3  # the first attempt and max_retries, no more
        assert [o[1:] for o in outcomes] == [("connect_error", "retry")] * 3
    finally:
        await fwd.session.close()
        await runner.cleanup()


async def test_each_attempt_tells_the_backend_what_is_left_of_the_first_token_objective(backends):
    # The first backend asked takes 0.3 s to refuse; the next hears of 0.8 s less that.
    seen: list[dict[str, str]] = []

    async def slow_then_answer(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        if len(seen) == 1:
            await asyncio.sleep(0.3)
            return await refuse(request)
        return await answer(request)

    pool, fwd = await backends(slow_then_answer, slow_then_answer)
    headers = {"content-type": "application/json", FIRST_TOKEN_BY: repr(time.monotonic() + 0.8)}
    body = b'{"model": "m", "prompt": "x"}'
    deadline = time.monotonic() + 30
    up = await fwd.send(pool, "/v1/completions", body, headers, deadline, False, None, Attempt())
    assert up.status == 200 and len(seen) == 2
    first, second = (int(h["x-slo-ttft-ms"]) for h in seen)
    assert 700 <= first <= 800 and second <= first - 250
    assert not any(FIRST_TOKEN_BY in {k.lower() for k in h} for h in seen)  # never sent on


async def test_routing_weighs_the_priority_sent_and_every_attempt_gives_its_count_back(backends):
    """What routing weighs for a priority (``Pool.load_score``, ``Pool.outranked``) comes from
    the ``x-priority`` the gateway sends; a refused attempt and a cancelled one give their
    count back."""
    hang = Hang()
    refusals: list[str | None] = []

    async def counted_refusal(request: web.Request) -> web.Response:
        refusals.append(request.headers.get("x-priority"))
        return await refuse(request)

    pool, fwd = await backends(hang.handler, counted_refusal)
    stuck, refusing = pool.backends
    stuck.kind = refusing.kind = "poise"

    def sent(priority: str) -> asyncio.Task[Any]:
        headers = {"content-type": "application/json", "x-priority": priority}
        body = b'{"model": "m", "prompt": "x", "stream": true}'
        due = time.monotonic() + 30
        return asyncio.create_task(
            fwd.send(pool, "/v1/completions", body, headers, due, True, None, Attempt())
        )

    refusing.healthy = False
    batch = [sent("10") for _ in range(3)]
    while stuck.inflight < 3:
        await asyncio.sleep(0.01)
    refusing.healthy = True
    refusing.attempt_started(0)  # an interactive request of another client's, say, is there
    # Three batch attempts on one, an interactive one on the other: an interactive request
    # goes where the batch ones are (each counts for a tenth for it); a batch one goes to the
    # other.
    hang.arrived.clear()
    interactive = sent("0")
    await asyncio.wait_for(hang.arrived.wait(), 5)
    assert stuck.inflight_by_priority == {10: 3, 0: 1} and refusals == []
    timers = set(pool.latency._series[stuck.url].streams)
    assert len(timers) == 4 and not any(t.untimed for t in timers)  # none was outranked yet
    # Another batch request goes to the idle one, is refused there (its count comes back) and
    # moves to the busier one; started while the interactive one is served, it times nothing.
    late = sent("10")
    while stuck.inflight < 5:
        await asyncio.sleep(0.01)
    assert refusals == ["10"] and refusing.inflight_by_priority == {0: 1}
    assert stuck.inflight_by_priority == {10: 4, 0: 1}
    (newest,) = set(pool.latency._series[stuck.url].streams) - timers
    assert newest.untimed
    for task in (*batch, interactive, late):
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert stuck.inflight == 0 and stuck.inflight_by_priority == {}
    assert refusing.inflight == 1  # the other client's, still there
