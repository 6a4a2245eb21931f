"""The forwarder against real HTTP backends on loopback: a refusal for load moves the request to
another backend at once, refusals everywhere reach the client at once, and an attempt waiting on
a backend that the health checks find dead moves elsewhere instead of waiting for it."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from poise.gateway.config import GatewaySettings
from poise.gateway.forward import Attempt, Forwarder, Timeouts
from poise.gateway.pool import Pool
from poise.protocol import APIError
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

    async def make(*handlers: Handler) -> tuple[Pool, Forwarder]:
        urls = []
        for h in handlers:
            runner, url = await serve(h)
            runners.append(runner)
            urls.append(url)
        settings = GatewaySettings.model_validate(
            {"models": {"m": {"backends": [{"url": u} for u in urls]}}}
        )
        pool = Pool("m", settings, time.monotonic, random.Random(0))
        session = aiohttp.ClientSession()
        sessions.append(session)
        # Backoff that would show: a retry that slept would take 0.5 s or more.
        policy = RetryPolicy(max_retries=2, base_s=0.5, cap_s=1.0)
        fwd = Forwarder(session, policy, RetryBudget(), Timeouts(2.0, 60.0))
        return pool, fwd

    yield make
    for s in sessions:
        await s.close()
    for r in runners:
        await r.cleanup()


async def send(pool: Pool, fwd: Forwarder, journey: Attempt | None = None):
    return await fwd.send(
        pool,
        "/v1/completions",
        b'{"model": "m", "prompt": "x"}',
        {"content-type": "application/json"},
        time.monotonic() + 30,
        False,
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
