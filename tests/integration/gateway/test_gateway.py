"""The gateway as a real process in front of real `poise serve` replicas, driven by clients."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from gatewayproc import GatewayProcess
from serverproc import ServerProcess

FAST_HEALTH = {"interval_s": 0.5, "timeout_s": 2.0, "healthy_after": 1, "unhealthy_after": 1}


@pytest.fixture(scope="module")
def replicas(llama_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("replicas")
    procs = [ServerProcess(llama_dir, log_dir, "--enable-fault-injection") for _ in range(2)]
    yield procs
    for p in procs:
        p.stop()


def backends(procs):
    return [{"url": p.url} for p in procs]


@pytest.fixture
def gateway(replicas, tmp_path):
    started = []

    def start(**config):
        cfg = {"models": {"m": {"backends": backends(replicas)}}, "health": FAST_HEALTH, **config}
        g = GatewayProcess(cfg, tmp_path)
        started.append(g)
        return g

    yield start
    for g in started:
        g.stop()
    for r in replicas:
        if r.proc.poll() is None:
            r.faults(step_delay_s=0, fail_steps=0)


def test_openai_client_through_the_gateway_matches_the_replica(gateway, replicas):
    g = gateway()
    via = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
    direct = openai.OpenAI(base_url=replicas[0].url + "/v1", api_key="x", max_retries=0)
    kw = {"model": "m", "prompt": "The gateway", "max_tokens": 24, "temperature": 0}
    a = via.completions.create(**kw)
    b = direct.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.total_tokens == b.usage.total_tokens
    streamed = "".join(
        c.choices[0].text for c in via.completions.create(**kw, stream=True) if c.choices
    )
    assert streamed == b.choices[0].text
    chat = via.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in via.models.list().data] == ["m"]


def test_gateway_errors_have_the_openai_shape(gateway):
    g = gateway()
    r = httpx.post(g.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(g.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(g.url + "/v1/completions", content=b"x" * (5 << 20))
    assert r.status_code == 413
    # A backend's own 400 passes through untouched and is not retried.
    r = httpx.post(g.url + "/v1/completions", json={"model": "m", "prompt": "x", "top_p": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"


def test_keys_and_rate_limits(gateway):
    g = gateway(
        keys=[
            {"key": "sk-limited-1", "name": "limited", "requests_per_minute": 2},
            {"key": "sk-other-22", "name": "other"},
        ]
    )
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    assert httpx.post(g.url + "/v1/completions", json=body).status_code == 401
    auth = {"Authorization": "Bearer sk-limited-1"}
    statuses = [httpx.post(g.url + "/v1/completions", json=body, headers=auth) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    refused = statuses[-1]
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    other = {"Authorization": "Bearer sk-other-22"}
    assert httpx.post(g.url + "/v1/completions", json=body, headers=other).status_code == 200


def test_a_failing_replica_is_retried_elsewhere(gateway, replicas):
    g = gateway(retry={"max_retries": 2, "base_s": 0.0, "cap_s": 0.0})
    replicas[0].faults(fail_steps=1000)
    body = {"model": "m", "prompt": "retry me", "max_tokens": 4}
    with httpx.Client(timeout=30) as c:
        statuses = [c.post(g.url + "/v1/completions", json=body).status_code for _ in range(12)]
    assert statuses == [200] * 12
    text = httpx.get(g.url + "/metrics").text
    assert "poise_gateway_retries_total" in text


def test_kill_9_under_load_loses_no_request(gateway, replicas, llama_dir, tmp_path):
    """Every request completes (retried elsewhere) or ends with an explicit error; none vanish."""
    extra = ServerProcess(llama_dir, tmp_path)
    try:
        g = gateway(models={"m": {"backends": [{"url": extra.url}, {"url": replicas[1].url}]}})
        body = {"model": "m", "prompt": "steady load", "max_tokens": 16, "stream": True}

        def one(i: int) -> str:
            try:
                with httpx.stream("POST", g.url + "/v1/completions", json=body, timeout=60) as r:
                    if r.status_code != 200:
                        r.read()
                        return f"http {r.status_code}"
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                if lines[-1] != "data: [DONE]":
                    return "truncated"
                return "error event" if any('"error"' in ln for ln in lines) else "ok"
            except httpx.HTTPError as exc:
                return f"transport {type(exc).__name__}"

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(one, i) for i in range(60)]
            time.sleep(1.0)
            os.kill(extra.proc.pid, signal.SIGKILL)
            results = [f.result() for f in futures]
        assert "truncated" not in results and not any(r.startswith("transport") for r in results)
        assert results.count("ok") >= 50, results
        # Once it is known to be down, everything goes to the survivor.
        after = [one(0) for _ in range(5)]
        assert after == ["ok"] * 5
    finally:
        extra.stop()
