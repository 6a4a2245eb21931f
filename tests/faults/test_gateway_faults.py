"""Faults behind and around a real gateway process: a hung replica, a slow one, a failing one
under concurrency, a flood of low-priority work, and Redis-shared limits (two gateways, then
Redis killed). Each counts what clients saw: nothing may vanish."""

from __future__ import annotations

import math
import os
import signal
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gatewayproc import GatewayProcess, gateway_metric, gateways_before
from redisproc import RedisServer

FAST_HEALTH = {"interval_s": 0.3, "timeout_s": 0.5, "healthy_after": 1, "unhealthy_after": 1}
SMALL = {"model": "m", "prompt": "hello there", "max_tokens": 4, "temperature": 0}


@pytest.fixture
def pair(healthy_pair):
    return healthy_pair


@pytest.fixture
def gateway(pair, tmp_path):
    with gateways_before(pair, tmp_path, FAST_HEALTH) as start:
        yield start


def metric(g: GatewayProcess, name: str, **labels: str) -> float:
    """Sum of a gateway metric over the series whose labels include ``labels``."""
    return gateway_metric(g.url, name, **labels)


def post(g: GatewayProcess, body: dict, key: str | None = None, timeout: float = 30):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    try:
        r = httpx.post(g.url + "/v1/completions", json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}", time.perf_counter() - t0, {}
    return r.status_code, time.perf_counter() - t0, r.headers


def test_hung_replica_is_cut_off_then_returns_through_half_open(gateway, pair):
    """(b) SIGSTOP one replica under steady load: it is taken out within the configured time,
    traffic moves to the other, and after SIGCONT it comes back through half-open."""
    hung, other = pair
    g = gateway(
        timeouts={"connect_s": 0.5, "first_byte_s": 1.0, "stream_idle_s": 1.0, "total_s": 20},
        breaker={
            "failure_rate": 0.5,
            "min_calls": 2,
            "window_size": 10,
            "open_s": 1.0,
            "half_open_calls": 1,
        },
        retry={"max_retries": 2, "base_s": 0.0, "cap_s": 0.0},
    )
    os.kill(hung.proc.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: post(g, SMALL), range(24)))
        cut_off = time.monotonic() - stopped_at
        assert all(status == 200 for status, _, _ in results), results
        # Both mechanisms took it out: its breaker opened on the attempts it left unanswered
        # (first-byte timeouts, or attempts cut off when it went down: either counts as a
        # failure), and the active health checks marked it down. The other one's breaker never
        # opened: it served everything.
        opened = metric(g, "poise_gateway_breaker_transitions_total", backend=hung.url, to="open")
        assert opened >= 1
        assert metric(g, "poise_gateway_backend_healthy", backend=hung.url) == 0
        assert metric(g, "poise_gateway_breaker_transitions_total", backend=other.url) == 0
        assert metric(g, "poise_gateway_backend_healthy", backend=other.url) == 1
        # Once cut off, requests no longer wait for the hung replica's timeout.
        late = [post(g, SMALL)[1] for _ in range(5)]
        assert max(late) < 0.9, (late, cut_off)
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        post(g, SMALL)
        if metric(g, "poise_gateway_breaker_transitions_total", backend=hung.url, to="closed"):
            break
        time.sleep(0.1)
    assert metric(g, "poise_gateway_breaker_transitions_total", backend=hung.url, to="half_open")
    assert metric(g, "poise_gateway_breaker_transitions_total", backend=hung.url, to="closed")
    assert metric(g, "poise_gateway_breaker_state", backend=hung.url) == 0


def test_slow_replica_trips_the_slow_call_breaker(gateway, pair):
    """(c) A replica made slow by fault injection: the slow-call rate opens its breaker."""
    slow, fast = pair
    g = gateway(
        # The health checks' generation probe must not take it out first: a one-token probe
        # takes a step or two, 0.5-0.8 s on the slow replica.
        health={**FAST_HEALTH, "timeout_s": 3.0},
        breaker={
            # Slow: over 0.5 s plus 0.15 s a token. The fast replica takes 20-100 ms a token
            # (more while other processes share the two cores); the slow one 400 ms.
            "slow_call_s": 0.5,
            "slow_token_s": 0.15,
            "slow_call_rate": 0.5,
            "failure_rate": 0.9,
            "min_calls": 3,
            "window_size": 10,
            "open_s": 30.0,
        },
    )
    slow.faults(step_delay_s=0.4)  # 4 tokens (5 steps): ~2 s, past the 1.1 s allowed
    for _ in range(16):
        status, _, _ = post(g, SMALL)
        assert status == 200
    assert metric(g, "poise_gateway_breaker_transitions_total", backend=slow.url, to="open") >= 1
    assert metric(g, "poise_gateway_breaker_state", backend=slow.url) == 2
    assert metric(g, "poise_gateway_breaker_state", backend=fast.url) == 0
    took = [post(g, SMALL)[1] for _ in range(5)]
    assert statistics.median(took) < 0.4, took  # everything now goes to the fast one


def test_retry_budget_caps_retries_while_one_replica_fails(gateway, pair):
    """(d) One replica answers every request with 500: retries succeed on the other, and under
    concurrency the budget bounds how many retries run at once."""
    failing = pair[0]
    g = gateway(
        retry={
            "max_retries": 1,
            # Backoff long enough that retries overlap, whatever the machine's speed.
            "base_s": 1.0,
            "cap_s": 1.0,
            "budget_ratio": 0.2,
            "budget_min_concurrent": 2,
            # A short window with the floor of the default one (10 a 10 s window): the
            # sequential requests below come after the burst's retries have left it.
            "budget_window_s": 2.0,
            "budget_min_per_s": 5.0,
        },
        # Keep the failing replica in rotation, so that every other request needs a retry:
        # no breaker, no ejection, and a liveness check that its failing steps do not fail.
        breaker={"failure_rate": 1.0, "min_calls": 1000},
        ejection={"consecutive_failures": 1000},
        health={**FAST_HEALTH, "timeout_s": 2.0, "unhealthy_after": 3, "generate_probe": False},
    )
    failing.faults(fail_steps=10**6)
    with ThreadPoolExecutor(30) as pool:
        results = list(pool.map(lambda _: post(g, SMALL)[0], range(60)))
    # An explicit answer for every one: 429 when the healthy replica, taking all the load,
    # predicts more than its default queueing budget.
    assert set(results) <= {200, 429, 502}, results
    retries = metric(g, "poise_gateway_retries_total")
    refused = metric(g, "poise_gateway_retry_budget_exhausted_total")
    peak = metric(g, "poise_gateway_retries_peak_concurrent")
    # At most the one retry each allows. (Where a retry went is not fixed: after a 429 from
    # the healthy one, the retry goes to the failing one, and its 500 ends the request as a
    # 502 with no budget refusal.)
    assert 0 < retries <= len(results)
    # The budget said no, and it showed: each refusal answered explicitly, 502 after a 500 or
    # 429 (with Retry-After) when the last backend asked had refused for load.
    assert refused > 0
    assert refused <= results.count(502) + results.count(429)
    assert peak <= max(2, math.floor(0.2 * 30)), peak
    # Sequential requests are within the budget's minimum: all of them succeed, once the
    # burst's retries have left the budget's window (they were in it when the burst ran fast).
    time.sleep(2.5)
    assert [post(g, SMALL)[0] for _ in range(6)] == [200] * 6


def test_flood_sheds_low_priority_while_high_priority_keeps_its_latency(gateway, pair):
    """(e) Several times capacity of low-priority work: high-priority requests go first and
    keep their latency (the gateway's capacity counts, for them, only their own priority, so
    they pass the queue the low-priority work fills); low-priority ones are refused with 429
    or 503 and Retry-After, none vanish."""
    for p in pair:
        p.faults(step_delay_s=0.02)
    g = gateway(
        keys=[
            {"key": "sk-high-000", "name": "high", "priority": 0},
            {"key": "sk-low-0000", "name": "low", "priority": 10},
        ],
        admission={"max_inflight_per_backend": 2, "max_queue": 6, "queue_ttl_s": 10},
        # Fourteen client threads flood two cores here: a probe may well wait a second for
        # the engine's next step. This test is about shedding, not about health checks.
        health={**FAST_HEALTH, "timeout_s": 2.0, "unhealthy_after": 3},
    )
    body = {**SMALL, "max_tokens": 8}
    baseline = statistics.median(post(g, body, "sk-high-000")[1] for _ in range(5))
    stop = time.monotonic() + 6.0
    low_results: list = []

    def flood() -> None:
        while time.monotonic() < stop:
            low_results.append(post(g, body, "sk-low-0000"))

    with ThreadPoolExecutor(16) as pool:
        floods = [pool.submit(flood) for _ in range(14)]
        time.sleep(1.0)
        high = [post(g, body, "sk-high-000") for _ in range(10)]
        for f in floods:
            f.result()
    assert all(status == 200 for status, _, _ in high), high
    high_p50 = statistics.median(t for _, t, _ in high)
    assert high_p50 < 2.5 * baseline + 0.1, (high_p50, baseline)
    statuses = [s for s, _, _ in low_results]
    assert set(statuses) <= {200, 429, 503}, set(statuses)
    shed = [h for s, _, h in low_results if s in (429, 503)]
    assert shed and all(int(h["retry-after"]) >= 1 for h in shed)
    assert statuses.count(200) > 0  # shed, not starved outright
    refused = sum(
        metric(g, "poise_gateway_shed_total", reason=r) for r in ("shed", "queue_full", "shedding")
    )
    assert refused > 0


def test_redis_limits_hold_across_two_gateways(gateway, tmp_path):
    """(f) Two gateway processes share one limit through Redis: together they admit what the
    limit allows (+1 %), where local limits would each have admitted the whole of it."""
    with RedisServer(tmp_path) as redis_server:
        keys = [{"key": "sk-shared-00", "name": "shared", "requests_per_minute": 30}]
        shared = {"redis_url": redis_server.url}
        gws = [gateway(keys=keys, rate_limits=shared) for _ in range(2)]
        body = {**SMALL, "max_tokens": 1}
        t0 = time.monotonic()
        statuses = [post(gws[i % 2], body, "sk-shared-00")[0] for i in range(80)]
        elapsed = time.monotonic() - t0
        allowed = 30 + elapsed * 30 / 60  # the burst plus what refilled meanwhile
        admitted = statuses.count(200)
        assert set(statuses) == {200, 429}
        assert 30 <= admitted <= math.floor(allowed * 1.01), (admitted, allowed)
        assert all(metric(g, "poise_gateway_ratelimit_redis_up") == 1 for g in gws)


def test_redis_killed_mid_run_the_gateway_serves_on_local_limits(gateway, tmp_path):
    """(g) Redis dies under traffic: no request fails for it; the gateway says so and later
    goes back to shared limits when Redis is back."""
    with RedisServer(tmp_path) as redis_server:
        keys = [{"key": "sk-generous0", "name": "generous", "requests_per_minute": 6000}]
        g = gateway(keys=keys, rate_limits={"redis_url": redis_server.url, "redis_retry_s": 0.5})
        body = {**SMALL, "max_tokens": 1}
        before = [post(g, body, "sk-generous0")[0] for _ in range(5)]
        redis_server.kill()
        during = [post(g, body, "sk-generous0")[0] for _ in range(10)]
        assert before == [200] * 5 and during == [200] * 10
        assert metric(g, "poise_gateway_ratelimit_redis_up") == 0
        assert metric(g, "poise_gateway_ratelimit_fallbacks_total") >= 1
        assert "Redis unreachable" in g.log_path.read_text()
        redis_server.start()
        time.sleep(0.6)
        after = [post(g, body, "sk-generous0")[0] for _ in range(3)]
        assert after == [200] * 3 and metric(g, "poise_gateway_ratelimit_redis_up") == 1


def test_an_ejection_by_one_gateway_is_avoided_by_every_gateway(gateway, pair, tmp_path):
    """Two gateways share breaker and ejection verdicts through Redis: a replica that fails
    under one gateway's traffic is avoided by the other within one health interval, though
    the other has sent it nothing. Without Redis, each would learn it alone, by failing."""
    with RedisServer(tmp_path) as redis_server:
        shared = {"redis_url": redis_server.url}
        ejection = {"consecutive_failures": 2, "base_s": 30, "jitter_s": 0}
        a = gateway(rate_limits=shared, ejection=ejection)
        b = gateway(rate_limits=shared, ejection=ejection)
        pair[0].faults(error_status=500)
        try:
            # Only a sees traffic; replica 0's 500s are retried on replica 1 and eject it.
            assert [post(a, SMALL)[0] for _ in range(20)] == [200] * 20
            assert pair[0].url not in eligible(a)
            interval = FAST_HEALTH["interval_s"]
            end = time.monotonic() + 2 * interval + 0.5
            while pair[0].url in eligible(b) and time.monotonic() < end:
                time.sleep(0.05)
            assert pair[0].url not in eligible(b), b.log()
            # ... on a's verdict: b itself never had a failed attempt on it.
            assert metric(b, "poise_gateway_remote_verdicts_total") >= 1
            assert metric(b, "poise_gateway_upstream_attempts_total", outcome="error") == 0
            # Through b now, every request goes straight to replica 1: no failed attempt.
            answers = [post(b, SMALL) for _ in range(6)]
            assert [s for s, _, _ in answers] == [200] * 6
            assert {h["x-poise-attempt-count"] for _, _, h in answers} == {"1"}
        finally:
            pair[0].faults(error_status=0)


def eligible(g: GatewayProcess) -> list[str]:
    state = httpx.get(g.url + "/debug/state", timeout=5).json()
    return state["models"]["m"]["eligible"]


def test_cached_answer_is_the_last_fallback_and_says_so(gateway, pair):
    g = gateway(
        models={"m": {"backends": [{"url": p.url} for p in pair], "cache_fallback": {}}},
        retry={"max_retries": 1, "base_s": 0.0, "cap_s": 0.0},
    )
    body = {**SMALL, "max_tokens": 6}
    fresh = httpx.post(g.url + "/v1/completions", json=body, timeout=30)
    assert fresh.status_code == 200 and "x-poise-fallback" not in fresh.headers
    for p in pair:
        p.faults(fail_steps=10**6)
    cached = httpx.post(g.url + "/v1/completions", json=body, timeout=30)
    assert cached.status_code == 200 and cached.headers["x-poise-fallback"] == "cache"
    assert cached.json() == fresh.json()
    # Nothing stored for these: an explicit failure (502, or 503 once checks mark both down).
    other = httpx.post(g.url + "/v1/completions", json={**body, "max_tokens": 7}, timeout=30)
    assert other.status_code in (502, 503) and "x-poise-fallback" not in other.headers
    sampled = httpx.post(g.url + "/v1/completions", json={**body, "temperature": 1}, timeout=30)
    assert sampled.status_code in (502, 503) and "x-poise-fallback" not in sampled.headers
    assert metric(g, "poise_gateway_fallbacks_total", kind="cache") == 1
