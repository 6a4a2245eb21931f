"""The health round by kind: a one-token generation on other engines, and a late probe on an
engine whose token counts still grow is busy, not stuck."""

from __future__ import annotations

import httpx

from poise.gateway.config import BackendSettings, HealthSettings
from poise.gateway.health import check_once
from poise.gateway.pool import Backend
from poise.resilience.breaker import BreakerConfig, CircuitBreaker


def backend(kind: str = "vllm") -> Backend:
    settings = BackendSettings.model_validate({"url": "http://b:8000", "kind": kind})
    return Backend("m", settings, CircuitBreaker(BreakerConfig(), lambda: 0.0), kind=settings.kind)


class Engine:
    """What a vLLM answers: its probe late or in time, its counters as they stand."""

    def __init__(self) -> None:
        self.late = False
        self.tokens = 100.0
        self.asked: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.asked.append((request.method, request.url.path))
        if request.url.path == "/v1/completions":
            if self.late:
                raise httpx.ReadTimeout("late", request=request)
            return httpx.Response(200, json={"choices": [{"text": "x"}]})
        if request.url.path == "/metrics":
            text = (
                'vllm:num_requests_running{model_name="m"} 4\n'
                f'vllm:generation_tokens_total{{model_name="m"}} {self.tokens}\n'
            )
            return httpx.Response(200, text=text)
        return httpx.Response(404)


async def test_a_late_probe_while_tokens_flow_is_busy_and_without_them_stuck():
    engine = Engine()
    b = backend()
    cfg = HealthSettings()
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        assert await check_once(client, b, cfg)
        assert ("POST", "/v1/completions") in engine.asked  # a generation, not /health
        assert b.load.running == 4.0 and b.load.processed == 100.0
        engine.late = True
        engine.tokens = 180.0  # it generated 80 tokens since: busy
        assert await check_once(client, b, cfg)
        engine.tokens = 183.0  # a few: what the probes themselves would have processed
        assert not await check_once(client, b, cfg)  # nothing else since: stuck


async def test_a_failed_load_read_fails_no_round():
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            raise httpx.ReadTimeout("slow", request=request)
        return httpx.Response(200, json={})

    b = backend()
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        assert await check_once(client, b, HealthSettings())
    assert b.load.at is None  # no report: stale, which routing counts as busy


async def test_a_hosted_backend_is_asked_its_models_not_a_generation():
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, json={"data": []})

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        assert await check_once(client, backend("openai"), HealthSettings())
    assert asked == ["/v1/models"]


async def test_on_the_first_round_running_requests_are_the_benefit_of_the_doubt():
    """Nothing to compare the counts with yet: a late probe on an engine that says it is
    running requests is busy for that round; one running nothing is down at once."""
    engine = Engine()
    engine.late = True
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        assert await check_once(client, backend(), HealthSettings())

    def idle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text='vllm:generation_tokens_total{model_name="m"} 5\n')
        raise httpx.ReadTimeout("late", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(idle)) as client:
        assert not await check_once(client, backend(), HealthSettings())


async def test_a_poise_replicas_deterministic_mode_is_read_with_every_check():
    """What its health answer says now: a replica restarted with the other setting on the same
    address is seen as it is (a stream it continues is counted exact only while it says so)."""
    said: dict[str, object] = {"deterministic": True, "numerics": "f1"}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "reason": "", **said})
        return httpx.Response(200, text="")

    b = backend("poise")
    assert b.numerics is None  # until it says so
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        assert await check_once(client, b, HealthSettings())
        assert b.numerics == "f1"
        said = {"deterministic": True}  # no fingerprint: nothing to match a stream against
        assert await check_once(client, b, HealthSettings())
        assert b.numerics is None
        said = {"deterministic": True, "numerics": "f2"}  # restarted on another build
        assert await check_once(client, b, HealthSettings())
        assert b.numerics == "f2"
        said = {}  # a replica of before the mode, or one started without it
        assert await check_once(client, b, HealthSettings())
        assert b.numerics is None
