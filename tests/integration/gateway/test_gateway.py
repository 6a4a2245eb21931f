"""The gateway as a real process in front of real `poise serve` replicas, driven by clients."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from gatewayproc import backends, gateway_metric, gateways_before
from poise.launcher import free_port
from serverproc import ServerProcess, start_servers

FAST_HEALTH = {"interval_s": 0.5, "timeout_s": 2.0, "healthy_after": 1, "unhealthy_after": 1}


@pytest.fixture
def replicas(healthy_pair):
    return healthy_pair


@pytest.fixture
def gateway(replicas, tmp_path):
    with gateways_before(replicas, tmp_path, FAST_HEALTH) as start:
        yield start


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


def test_the_replica_s_other_routes_pass_through_the_gateway(gateway, replicas):
    """/tokenize and /detokenize (vLLM's, at the root) answer through the gateway as the
    replica answers them; a route the replica does not serve is its own 404."""
    g = gateway()
    asked = {"model": "m", "prompt": "The gateway forwards", "return_token_strs": True}
    via = httpx.post(g.url + "/tokenize", json=asked)
    direct = httpx.post(replicas[0].url + "/tokenize", json=asked)
    assert via.status_code == direct.status_code == 200 and via.json() == direct.json()
    back = httpx.post(g.url + "/detokenize", json={"model": "m", "tokens": via.json()["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"].endswith("The gateway forwards")
    wrong = {"model": "m", "tokens": "x"}
    bad = httpx.post(g.url + "/detokenize", json=wrong)
    refused = httpx.post(replicas[1].url + "/detokenize", json=wrong)
    assert bad.status_code == refused.status_code == 400 and bad.json() == refused.json()
    r = httpx.post(g.url + "/v1/embeddings", json={"model": "m", "input": "x"})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


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
    # Resume state is the gateway's to set: from a client it would jump replicas' queues.
    resume = {"token_ids": [1], "text_chars": 1, "id": "x", "created": 1}
    body = {"model": "m", "prompt": "x", "poise_resume": resume}
    r = httpx.post(g.url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "poise_resume"


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
    # Every answer carries the limits, as OpenAI's do; the first one leaves one request.
    assert statuses[0].headers["x-ratelimit-limit-requests"] == "2"
    assert statuses[0].headers["x-ratelimit-remaining-requests"] == "1"
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
        answers = [c.post(g.url + "/v1/completions", json=body) for _ in range(12)]
    assert [r.status_code for r in answers] == [200] * 12
    # Each answer says how many upstream attempts it took (as Envoy's x-envoy-attempt-count):
    # the ones that met the failing replica first took two.
    attempts = sorted(int(r.headers["x-poise-attempt-count"]) for r in answers)
    assert set(attempts) <= {1, 2} and attempts[-1] == 2
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
                        return f"http {r.status_code} {r.read().decode()[:300]}"
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                if lines[-1] != "data: [DONE]":
                    return "truncated"
                return next((ln for ln in lines if '"error"' in ln), "ok")
            except httpx.HTTPError as exc:
                return f"transport {type(exc).__name__}"

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, i) for i in range(60)]
            time.sleep(1.0)
            os.kill(extra.proc.pid, signal.SIGKILL)
            results = [f.result() for f in futures]
        assert "truncated" not in results and not any(r.startswith("transport") for r in results)
        # Nothing vanishes, nothing fails: what is not served is refused explicitly, up front,
        # by the survivor's admission on the defaults (a 429 with its reason) when its
        # predicted wait passes the TTFT budget, which a slow host reaches at this load.
        others = [r for r in results if r != "ok"]
        assert all(r.startswith("http 429") and '"overloaded"' in r for r in others), others
        assert results.count("ok") >= 40, others
        # Once it is known to be down, everything goes to the survivor.
        after = [one(0) for _ in range(5)]
        assert after == ["ok"] * 5
    finally:
        extra.stop()


def test_a_stream_continues_on_another_replica_when_its_replica_dies(gateway, llama_dir, tmp_path):
    """Greedy output through a mid-stream kill -9 is the same text as an unbroken run (here in
    float32 without the deterministic mode, so the gateway does not claim it is exact)."""
    pair = start_servers(2, llama_dir, tmp_path, "--enable-fault-injection", "--no-deterministic")
    try:
        g = gateway(models={"m": {"backends": backends(pair)}})
        body = {"model": "m", "prompt": "The quick brown fox", "max_tokens": 80, "temperature": 0}
        expected = httpx.post(pair[0].url + "/v1/completions", json=body, timeout=60).json()
        for p in pair:
            p.faults(step_delay_s=0.03)
        events, killed = [], None
        with httpx.stream(
            "POST", g.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    assert not line.startswith(":"), "token notes stay between gateway and replica"
                    continue
                events.append(line[6:])
                if len(events) == 20 and killed is None:
                    killed = next(p for p in pair if p.metric("vllm:num_requests_running") == 1)
                    os.kill(killed.proc.pid, signal.SIGKILL)
        assert killed is not None and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert {c["id"] for c in chunks} == {chunks[0]["id"]}, "one stream, one id"
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == expected["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        resumed = httpx.get(g.url + "/metrics").text
        # From the token position, not claimed exact: the replicas say they are not deterministic.
        want = 'poise_gateway_stream_migrations_total{mode="position",result="resumed"} 1.0'
        assert want in resumed
    finally:
        for p in pair:
            p.stop()


def test_a_chat_stream_survives_its_replica_through_the_openai_client(gateway, llama_dir, tmp_path):
    pair = start_servers(2, llama_dir, tmp_path, "--enable-fault-injection")
    try:
        g = gateway(models={"m": {"backends": backends(pair)}})
        kw = {
            "model": "m",
            "messages": [{"role": "user", "content": "Tell me about foxes"}],
            "max_tokens": 60,
            "temperature": 0,
        }
        direct = openai.OpenAI(base_url=pair[0].url + "/v1", api_key="x", max_retries=0)
        expected = direct.chat.completions.create(**kw).choices[0].message.content
        for p in pair:
            p.faults(step_delay_s=0.03)
        via = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
        parts, roles, killed = [], [], None
        for chunk in via.chat.completions.create(**kw, stream=True):
            delta = chunk.choices[0].delta
            roles += [delta.role] if delta.role else []
            parts.append(delta.content or "")
            if len(parts) == 15 and killed is None:
                killed = next(p for p in pair if p.metric("vllm:num_requests_running") == 1)
                os.kill(killed.proc.pid, signal.SIGKILL)
        assert killed is not None
        assert "".join(parts) == expected and roles == ["assistant"]
    finally:
        for p in pair:
            p.stop()


def test_a_streamed_answer_is_charged_what_it_used_not_its_max_tokens(gateway):
    """Tokens per minute: a stream that stops early gives back the rest of its estimate."""
    g = gateway(keys=[{"key": "sk-tokens-01", "name": "t", "tokens_per_minute": 300}])
    auth = {"Authorization": "Bearer sk-tokens-01"}
    # About 201 tokens estimated (prompt + max_tokens); a stop string ends it within a few.
    body = {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 200,
        "temperature": 0,
        "stop": [" ", "e", "a", "o"],  # OpenAI allows four
    }
    with httpx.stream(
        "POST", g.url + "/v1/completions", json={**body, "stream": True}, headers=auth
    ) as r:
        events = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    assert r.status_code == 200 and len(events) < 100
    # Charged the full estimate, 300 - 201 would leave too little for a second such request.
    again = httpx.post(g.url + "/v1/completions", json=body, headers=auth, timeout=30)
    assert again.status_code == 200, again.text


def test_gateway_metrics_move_by_exactly_what_happened(gateway, replicas):
    """A known sequence (successes, a stream, a rate limit, a retry then a fallback to another
    model's pool, a shed) moves the counters by exactly those amounts."""
    failing, serving = replicas
    failing.faults(fail_steps=10**6)  # every completion it is sent fails with a 500
    g = gateway(
        models={
            "m": {"backends": [{"url": serving.url}]},
            "r": {"backends": [{"url": failing.url, "model": "m"}], "fallback": ["m"]},
        },
        keys=[
            {"key": "sk-free-0000", "name": "free", "priority": 0},
            {"key": "sk-limited00", "name": "limited", "requests_per_minute": 2},
            {"key": "sk-low-00000", "name": "low", "priority": 10},
        ],
        retry={"max_retries": 1, "base_s": 0.001, "cap_s": 0.002},
        breaker={"min_calls": 1000},
        ejection={"consecutive_failures": 1000},
        admission={"max_inflight_per_backend": 1, "max_queue": 1, "queue_ttl_s": 30},
        # Liveness only: the failing replica's steps fail, its HTTP side does not.
        health={**FAST_HEALTH, "generate_probe": False},
    )
    body = {"model": "m", "prompt": "count me", "max_tokens": 3, "temperature": 0}

    def post(key: str, **extra: object) -> httpx.Response:
        return httpx.post(
            g.url + "/v1/completions",
            json={**body, **extra},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )

    assert [post("sk-free-0000").status_code for _ in range(3)] == [200] * 3
    with httpx.stream(
        "POST",
        g.url + "/v1/completions",
        json={**body, "stream": True},
        headers={"Authorization": "Bearer sk-free-0000"},
        timeout=60,
    ) as s:
        assert s.status_code == 200 and "[DONE]" in s.read().decode()
    assert [post("sk-limited00").status_code for _ in range(3)] == [200, 200, 429]
    fell_back = post("sk-free-0000", model="r")
    assert fell_back.status_code == 200 and fell_back.headers["x-poise-fallback"] == "model:m"

    # Shed: one slow request holds the only place, a low-priority one waits in the one-place
    # queue, and a high-priority one arriving pushes it out.
    serving.faults(step_delay_s=0.1)
    with ThreadPoolExecutor(3) as pool:
        slow = pool.submit(post, "sk-free-0000", max_tokens=20)
        time.sleep(0.6)
        low = pool.submit(post, "sk-low-00000")
        time.sleep(0.4)
        high = pool.submit(post, "sk-free-0000")
        assert low.result().status_code == 429 and low.result().json()["error"]["code"] == "shed"
        assert slow.result().status_code == 200 and high.result().status_code == 200
    serving.faults(step_delay_s=0)

    m = lambda name, **labels: gateway_metric(g.url, name, **labels)  # noqa: E731
    assert m("poise_gateway_requests_total", model="m", outcome="ok") == 3 + 1 + 2 + 2
    assert m("poise_gateway_requests_total", outcome="rate_limited") == 1
    assert m("poise_gateway_rate_limited_total", limit="key:limited:rpm") == 1
    assert m("poise_gateway_requests_total", model="r", backend=serving.url, outcome="ok") == 1
    assert m("poise_gateway_upstream_attempts_total", backend=failing.url, outcome="error") == 2
    assert m("poise_gateway_retries_total", model="r") == 1
    assert m("poise_gateway_retries_total") == 1
    assert m("poise_gateway_fallbacks_total", model="r", kind="model") == 1
    assert m("poise_gateway_shed_total", model="m", reason="shed") == 1
    assert m("poise_gateway_requests_total", outcome="shed") == 1
    assert m("poise_gateway_time_to_first_token_seconds_count", model="m") == 1
    assert m("poise_gateway_request_duration_seconds_count") == 3 + 1 + 2 + 1 + 2
    assert m("poise_gateway_inflight_requests") == 0 and m("poise_gateway_queued_requests") == 0
    assert m("poise_gateway_health_probes_total", result="ok") > 0

    # Formula 2 from the same events: m lost 1 request of 9 to its queue (the one over its
    # key's quota is the client's: it counts neither way); r's only backend failed every
    # attempt, and the fallback to m's pool, which failed none, answered.
    assert m("poise_gateway_predicted_success_probability", model="m") == pytest.approx(8 / 9)
    auth = {"Authorization": "Bearer sk-free-0000"}
    state = httpx.get(g.url + "/debug/state", headers=auth, timeout=5).json()
    est_m, est_r = (state["models"][name]["success_estimate"] for name in ("m", "r"))
    assert (est_m["requests"], est_m["refused"], est_m["backends"]) == (9, pytest.approx(1 / 9), 1)
    assert (est_r["backends"], est_r["with_fallbacks"], est_r["probability"]) == (0.0, 1.0, 1.0)
    counted = state["success_tally"]["models"]["r"]["backends"][failing.url]
    assert counted == {"first": 1, "ok": 0, "failed": 2, "moved": 0, "overloaded": 0,
                       "broken": 0, "final": 0}  # fmt: skip


def test_one_json_log_line_per_request_without_the_prompt(gateway):
    g = gateway()
    r = httpx.post(
        g.url + "/v1/completions",
        json={"model": "m", "prompt": "secret prompt text", "max_tokens": 2},
        headers={"x-request-id": "req-abc-123"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-abc-123"
    assert httpx.post(g.url + "/v1/completions", json={"model": "nope"}).status_code == 404
    g.stop()
    lines = [json.loads(x) for x in g.log_path.read_text().splitlines() if x.startswith("{")]
    requests = [x for x in lines if x.get("event") == "request"]
    ok = next(x for x in requests if x["request_id"] == "req-abc-123")
    assert ok["model"] == "m" and ok["status"] == 200 and ok["outcome"] == "ok"
    assert ok["backend"].startswith("http://127.0.0.1:") and ok["output_tokens"] == 2
    assert (
        ok["duration_ms"] > 0 and ok["level"] == "info" and ok["logger"] == "poise.gateway.access"
    )
    missing = next(x for x in requests if x["status"] == 404)
    assert missing["outcome"] == "client_error" and missing["model"] == "nope"
    assert "secret prompt text" not in g.log_path.read_text()


def exported_names(url: str) -> set[str]:
    """Every sample name a ``/metrics`` page can carry, from its TYPE lines."""
    names: set[str] = set()
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "histogram":
                names |= {name + "_bucket", name + "_count", name + "_sum"}
    return names


def test_dashboard_and_alerts_name_only_metrics_poise_exports(gateway, replicas):
    # With Redis configured (here unreachable) the gateway also exports its Redis state.
    g = gateway(rate_limits={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    httpx.post(g.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
    exported = exported_names(g.url) | exported_names(replicas[0].url)
    deploy = Path(__file__).resolve().parents[3] / "deploy"
    rules = yaml.safe_load((deploy / "prometheus" / "alerts.yml").read_text())["groups"]
    recorded = {r["record"] for grp in rules for r in grp["rules"] if "record" in r}
    exprs = [r["expr"] for grp in rules for r in grp["rules"]]
    dashboard = json.loads((deploy / "grafana" / "poise.json").read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = set()
    for expr in exprs:
        named |= set(re.findall(r"\b(poise_[a-z0-9_]+|vllm:[a-z0-9_]+|poise:[a-z0-9_:]+)", expr))
    assert named, "the expressions name poise's metrics"
    unknown = {n for n in named if n not in exported and n not in recorded}
    assert not unknown, f"named but never exported: {sorted(unknown)}"


def test_debug_state_shows_breakers_queues_and_budget_behind_the_api_key(gateway, replicas):
    g = gateway(keys=[{"key": "sk-ops-00000", "name": "ops"}])
    assert httpx.get(g.url + "/debug/state").status_code == 401
    state = httpx.get(g.url + "/debug/state", headers={"Authorization": "Bearer sk-ops-00000"})
    assert state.status_code == 200
    body = state.json()
    pool = body["models"]["m"]
    assert {b["url"] for b in pool["backends"]} == {r.url for r in replicas}
    assert all(b["breaker"] == "closed" and b["healthy"] for b in pool["backends"])
    assert pool["queue"] == {"waiting": 0, "admitted": 0} and not pool["saturated"]
    assert body["retry_budget"]["active_retries"] == 0 and body["rate_limits"]["shared"] is False


def test_the_autoscaling_advice_follows_the_load(gateway):
    """Formula 5 live: about 4 requests/s against a service rate of 1/s per replica asks for
    the maximum (4); once the load stops, the advice comes down after the window."""
    g = gateway(
        autoscale={
            "service_rate_prior": 1.0,
            "max_replicas": 4,
            "scale_down_window_s": 2.0,
            "interval_s": 0.2,
            "rate_halflife_s": 1.0,
        }
    )
    body = {"model": "m", "prompt": "scale me", "max_tokens": 2}
    with httpx.Client(timeout=30) as c:
        end = time.monotonic() + 4
        while time.monotonic() < end:
            assert c.post(g.url + "/v1/completions", json=body).status_code == 200
            time.sleep(0.2)
        d = c.get(g.url + "/autoscale").json()["models"]["m"]["decision"]
        assert d["arrival_rate"] > 2 and d["service_rate"] == 1.0 and d["desired"] == 4
        assert d["replicas"] == 2 and d["queue"] == 0
        metrics = c.get(g.url + "/metrics").text
        assert 'poise_gateway_desired_replicas{model="m"} 4.0' in metrics
        assert 'poise_gateway_autoscale_serving_replicas{model="m"} 2.0' in metrics
        end = time.monotonic() + 40
        while time.monotonic() < end:
            d = c.get(g.url + "/autoscale").json()["models"]["m"]["decision"]
            if d["desired"] == 1:
                break
            time.sleep(0.5)
    assert d["desired"] == 1 and d["arrival_rate"] < 0.9


def test_bench_predicts_the_success_its_clients_then_see(gateway, replicas, tmp_path):
    """Without retries, a request succeeds exactly when its one attempt does: formula 2 over
    the gateway's counts for the run must come out at the share bench saw succeed."""
    flaky = replicas[0]
    flaky.faults(fail_steps=3)  # its next 3 engine steps raise: the requests in them fail
    g = gateway(
        models={"m": {"backends": [{"url": flaky.url}]}},
        retry={"max_retries": 0},
        breaker={"min_calls": 1000},
        ejection={"consecutive_failures": 1000},
        health={**FAST_HEALTH, "generate_probe": False},
    )
    results = tmp_path / "bench.json"
    out = subprocess.run(
        [
            sys.executable, "-m", "poise.cli", "bench", "--url", g.url, "--model", "m",
            "--concurrency", "2", "--num-requests", "24", "--prompt-len", "4",
            "--output-len", "4", "--results", str(results), "--no-progress",
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    success = json.loads(results.read_text())["summary"]["success"]
    assert 0.5 < success["observed"] < 1.0, success  # 1 to 6 of 24 failed
    assert success["predicted"] == pytest.approx(success["observed"])
    assert success["terms"]["first_attempt"] == pytest.approx(success["observed"])
    assert "predicted" in out.stdout and "+0.00 pp" in out.stdout
