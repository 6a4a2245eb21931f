"""Faults against a real replica process: disconnects, floods, deadlines, stalls, failing steps,
a dying engine, SIGTERM. Each asserts what a client or an operator would see."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

LONG = {"prompt": "The for statement", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def post(server, body: dict, timeout: float = 60, **headers: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=timeout)


def sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def wait_until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_disconnect_mid_stream_frees_blocks(start_server):
    server = start_server()
    server.faults(step_delay_s=0.05)
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
        assert server.metric("vllm:num_requests_running") == 1
        assert server.metric("vllm:kv_cache_usage_perc") > 0
    assert server.wait_metric("vllm:num_requests_running", 0, timeout=3) == 0
    assert server.wait_metric("vllm:kv_cache_usage_perc", 0, timeout=3) == 0
    assert server.metric('poise_requests_finished_total{model_name="m",outcome="abort"}') == 1


def test_disconnect_mid_non_stream_frees_blocks(start_server):
    server = start_server()
    server.faults(step_delay_s=0.05)
    with pytest.raises(httpx.ReadTimeout):
        post(server, LONG, timeout=1.0)
    assert server.wait_metric("vllm:num_requests_running", 0, timeout=3) == 0
    assert server.wait_metric("vllm:kv_cache_usage_perc", 0, timeout=3) == 0
    assert server.metric('poise_requests_finished_total{model_name="m",outcome="abort"}') == 1


def test_queue_bound_refuses_with_retry_after_while_admitted_complete(start_server):
    server = start_server("--max-num-seqs", "1", "--max-waiting-requests", "2")
    server.faults(step_delay_s=0.02)
    body = {"prompt": "hello", "max_tokens": 20, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: post(server, body), range(8)))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 8
    assert len(ok) >= 2 and refused  # one running (until its first token) + two waiting
    assert all(r.json()["usage"]["completion_tokens"] == 20 for r in ok)
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    # Each refusal counted under the reason it gave: mostly the queue bound, and on a slow
    # moment the predicted wait may refuse first (the same 429, another reason).
    reasons = Counter(r.json()["error"]["code"] for r in refused)
    assert reasons["queue_full"] >= 1, reasons
    for reason, count in reasons.items():
        rejected = f'poise_requests_rejected_total{{model_name="m",reason="{reason}"}}'
        assert server.metric(rejected) == count, reasons


def test_deadline_expiry_is_504_and_frees_blocks(start_server):
    server = start_server()
    server.faults(step_delay_s=0.05)
    r = post(server, LONG, **{"X-Request-Deadline-Ms": "400"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={**LONG, "stream": True},
        headers={"X-Request-Deadline-Ms": "600"},
        timeout=30,
    ) as s:
        assert s.status_code == 200  # the first token came in time
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "timeout"
    assert server.wait_metric("vllm:kv_cache_usage_perc", 0, timeout=3) == 0
    assert server.metric('poise_requests_finished_total{model_name="m",outcome="timeout"}') == 2


def test_slo_aware_admission_refuses_what_cannot_start_in_time(start_server):
    # A deliberate backlog, judged by the deadline alone: the queue-wait bound is off.
    server = start_server("--max-num-seqs", "1", "--queue-target-s", "0")
    server.faults(step_delay_s=0.05)
    body = {"prompt": "hello", "max_tokens": 10, "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:  # teach it the start rate: about one per 0.5 s
        list(pool.map(lambda _: post(server, body), range(6)))
    with ThreadPoolExecutor(6) as pool:
        backlog = [pool.submit(post, server, body) for _ in range(5)]
        time.sleep(0.3)
        r = post(server, body, **{"X-Request-Deadline-Ms": "500"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "deadline"
        assert int(r.headers["retry-after"]) >= 1
        assert all(f.result().status_code == 200 for f in backlog)


def test_a_request_s_own_latency_objective_is_judged_at_admission(start_server):
    # One slot, held by a stream of 60 steps of at least 50 ms: a newcomer starts in seconds.
    server = start_server("--max-num-seqs", "1")
    server.faults(step_delay_s=0.05)
    running = {"prompt": "hello", "max_tokens": 60, "ignore_eos": True, "stream": True}
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=running, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it runs
        late = post(server, body, **{"x-slo-ttft-ms": "500"})
        assert late.status_code == 429, late.text
        error = late.json()["error"]
        assert error["code"] == "slo_ttft" and "x-slo-ttft-ms" in error["message"]
        assert int(late.headers["retry-after"]) >= 2  # when it would have met it
        slow = post(server, body, **{"x-slo-tpot-ms": "10"})
        assert slow.status_code == 429 and slow.json()["error"]["code"] == "slo_tpot"
        bad = post(server, body, **{"x-slo-ttft-ms": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-slo-ttft-ms"
        # The same request without an objective, or with one it can meet, waits its turn.
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(post, server, body)
            patient = pool.submit(post, server, body, **{"x-slo-ttft-ms": "30000"})
            list(lines)
            assert plain.result().status_code == 200 and patient.result().status_code == 200
    for reason in ("slo_ttft", "slo_tpot"):
        rejected = f'poise_requests_rejected_total{{model_name="m",reason="{reason}"}}'
        assert server.metric(rejected) == 1
    assert server.wait_metric("vllm:num_requests_waiting", 0, timeout=3) == 0


def test_stalled_engine_fails_health_then_recovers(start_server):
    server = start_server("--watchdog-stall-s", "1")
    server.faults(stall_s=4)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, server, {"prompt": "x", "max_tokens": 3})
        t0 = time.monotonic()
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, timeout=3)
        assert time.monotonic() - t0 < 3
        health = httpx.get(server.url + "/health").json()
        assert "no progress" in health["reason"]
        assert httpx.get(server.url + "/ready").status_code == 503
        assert pending.result().status_code == 200  # it completes once the stall ends
    assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)


def test_failed_step_errors_its_requests_and_the_next_succeed(start_server):
    server = start_server()
    server.faults(fail_steps=1)
    r = post(server, {"prompt": "x", "max_tokens": 3})
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    assert post(server, {"prompt": "x", "max_tokens": 3}).status_code == 200
    server.faults(step_delay_s=0.05)
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30
    ) as s:
        lines = s.iter_lines()
        next(lines)
        server.faults(fail_steps=1)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "injected step failure" in json.loads(events[-2])["error"]["message"]
    assert server.metric("poise_engine_step_errors_total") == 2
    assert server.wait_metric("vllm:kv_cache_usage_perc", 0) == 0


def test_an_injected_error_status_fails_every_request_but_not_health(start_server):
    server = start_server()
    server.faults(error_status=503)
    r = post(server, {"prompt": "x", "max_tokens": 3})
    assert r.status_code == 503 and "injected fault" in r.json()["error"]["message"]
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3},
        timeout=30,
    )
    assert chat.status_code == 503
    # The engine is fine: health (a real generation) stays green, as with a broken deploy.
    assert httpx.get(server.url + "/health", params={"probe": "generate"}).status_code == 200
    bad = httpx.post(server.url + "/admin/faults", json={"error_status": 200}, timeout=5)
    assert bad.status_code in (400, 422)
    cleared = httpx.delete(server.url + "/admin/faults", timeout=5)
    assert cleared.json()["error_status"] == 0
    assert post(server, {"prompt": "x", "max_tokens": 3}).status_code == 200


def test_priority_sheds_the_lowest_waiting_first(start_server):
    # A deliberate queue, bounded by its length alone: the queue-wait bound is off.
    server = start_server(
        "--max-num-seqs", "1", "--max-waiting-requests", "1", "--queue-target-s", "0"
    )
    server.faults(step_delay_s=0.05)
    body = {"prompt": "hello", "max_tokens": 20, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        running = pool.submit(post, server, body)
        # Until its first token, the running request still holds its place in the queue.
        assert wait_until(
            lambda: (
                server.metric("vllm:num_requests_running") == 1
                and server.metric("poise_admission_waiting_requests") == 0
            )
        )
        low = pool.submit(post, server, {**body, "priority": 10})
        assert wait_until(lambda: server.metric("poise_admission_waiting_requests") == 1)
        high = post(server, body, **{"X-Priority": "0"})
        assert high.status_code == 200
        assert low.result().status_code == 429
        assert low.result().json()["error"]["code"] == "shed"
        assert running.result().status_code == 200


def test_generation_probe_does_not_queue_behind_user_work(start_server):
    # User work queued on purpose (the queue-wait bound off), for the probe to skip.
    server = start_server("--max-num-seqs", "1", "--queue-target-s", "0")
    server.faults(step_delay_s=0.05)
    body = {"prompt": "hello", "max_tokens": 60, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        work = [pool.submit(post, server, body) for _ in range(3)]
        assert wait_until(lambda: server.metric("vllm:num_requests_waiting") >= 1)
        t0 = time.monotonic()
        probe = httpx.get(server.url + "/health", params={"probe": "generate"}, timeout=10)
        assert probe.status_code == 200, probe.text
        assert time.monotonic() - t0 < 2.0  # one user request alone takes 3 s
        assert all(f.result().status_code == 200 for f in work)


def test_sigterm_drains_in_flight_refuses_new_and_exits_0(start_server):
    server = start_server("--drain-timeout", "30")
    server.faults(step_delay_s=0.04)
    body = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        inflight = [pool.submit(post, server, body) for _ in range(3)]
        assert wait_until(lambda: server.metric("vllm:num_requests_running") == 3)
        server.terminate()
        assert wait_until(lambda: httpx.get(server.url + "/ready").status_code == 503, 3)
        late = post(server, body)
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        # Its generation probe fails saying why: a gateway keeps what it holds there.
        probe = httpx.get(server.url + "/health", params={"probe": "generate"}, timeout=5)
        assert probe.status_code == 503 and probe.json()["status"] == "draining"
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # alive
        results = [f.result() for f in inflight]
    assert all(r.status_code == 200 for r in results)
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in results)
    assert server.proc.wait(30) == 0


def test_drain_timeout_ends_the_rest_with_an_explicit_error(start_server):
    server = start_server("--drain-timeout", "0.5")
    server.faults(step_delay_s=0.05)
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(post, server, LONG)

        def streamed() -> list[str]:
            with httpx.stream(
                "POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30
            ) as s:
                return sse_events(s)

        stream = pool.submit(streamed)
        assert wait_until(lambda: server.metric("vllm:num_requests_running") == 2)
        time.sleep(0.3)
        server.terminate()
        r = plain.result()
        events = stream.result()
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutdown"
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutdown"
    assert server.proc.wait(30) == 0


def test_engine_death_fails_health_and_exits_nonzero(start_server):
    server = start_server()
    server.faults(kill_loop=True)
    r = post(server, {"prompt": "x", "max_tokens": 3})
    assert r.status_code == 503, r.text
    # The server stays up for a second after its engine dies (app.py's ``load``), so that
    # whoever polls /health (a gateway, Kubernetes' liveness probe) sees why before it exits.
    health = httpx.get(server.url + "/health", timeout=2)
    assert health.status_code == 503, health.text
    body = health.json()
    assert body["status"] == "unhealthy"
    assert "injected engine loop death" in body["reason"], body
    assert server.proc.wait(30) == 1
    assert "engine loop died" in server.log()


def test_engine_core_killed_ends_streams_fails_health_and_exits_nonzero(start_server):
    server = start_server()
    assert server.engine_pid is not None, "the engine runs in a process of its own"
    server.faults(step_delay_s=0.05)
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(server.engine_pid, signal.SIGKILL)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine core process exited (killed by signal 9)" in error["message"]
    health = httpx.get(server.url + "/health", timeout=2)
    assert health.status_code == 503 and "killed by signal 9" in health.json()["reason"]
    assert server.proc.wait(30) == 1


def test_a_killed_server_s_engine_core_leaves_at_once(start_server):
    """The HTTP process killed (kill -9, the OOM killer): its engine core, a process of its
    own, must not go on using a core that the replicas taking over its work need. It took a
    second of a core to tear itself down, and a survivor's requests missed their TTFT."""
    server = start_server()
    pid = server.engine_pid
    assert pid is not None
    os.kill(server.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    server.proc.wait(5)

    def running() -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state not in ("Z", "X")  # a zombie has exited; its parent is gone

    assert wait_until(lambda: not running(), 2)
    assert time.monotonic() - t0 < 0.5


def test_stopped_engine_core_fails_health_while_http_answers(start_server):
    server = start_server("--watchdog-stall-s", "1")
    pid = server.engine_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:  # work for the frozen engine, so it is "stalled"
            pending = pool.submit(post, server, {"prompt": "x", "max_tokens": 2}, 30)
            assert wait_until(
                lambda: httpx.get(server.url + "/health", timeout=2).status_code == 503, 10
            )
            t0 = time.perf_counter()
            ready = httpx.get(server.url + "/ready", timeout=2)
            assert ready.status_code == 503 and time.perf_counter() - t0 < 1.0
            assert "no progress" in httpx.get(server.url + "/health").json()["reason"]
            os.kill(pid, signal.SIGCONT)
            assert pending.result(30).status_code == 200
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, 10)


def test_api_keys(start_server):
    server = start_server("--api-key", "k1", "--api-key", "k2")
    body = {"prompt": "x", "max_tokens": 2}
    assert post(server, body).status_code == 401
    wrong = post(server, body, Authorization="Bearer nope")
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert post(server, body, Authorization="Bearer k2").status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    # The live state names the engine's internals: guarded like the API.
    assert httpx.get(server.url + "/debug/state").status_code == 401
    state = httpx.get(server.url + "/debug/state", headers={"Authorization": "Bearer k1"}).json()
    assert state["role"] == "replica" and state["phase"] == "ready"
    assert state["kv_cache"]["total_blocks"] > 0 and state["kv_cache"]["usage"] == 0
    assert state["kv_cache"]["committed_blocks"] == 0  # nothing runs: nothing held or owed
    assert state["engine"]["running"] == 0 and state["health"]["healthy"] is True
    # Why requests wait: the running set's cap now and the step-time budget's fit (None
    # until it has seen enough steps).
    assert state["engine"]["max_running"] >= 1
    fit = state["engine"]["step_time_fit_ms"]
    assert fit is None or set(fit) == {"per_step", "per_decode", "per_prompt_token"}
