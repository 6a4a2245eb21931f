"""One trace from the client through the gateway to a replica, seen by an in-memory exporter.

The gateway and a replica run in this process (each a real uvicorn server on loopback, in a
thread of its own) so that one ``TracerProvider`` with an in-memory exporter sees both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gatewayproc import GatewayProcess
from poise.asgi import uvicorn_config
from poise.config import ServerSettings
from poise.gateway.app import create_gateway_app
from poise.gateway.config import GatewaySettings
from poise.launcher import answers_ok, free_port
from poise.server.app import create_app
from serverproc import ServerProcess

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CLIENT_TRACE = int("0af7651916cd43dd8448eb211c80319c", 16)


def broken_backend() -> Starlette:
    """Passes health checks, answers every completion with 503."""

    async def ok(request: Any) -> Response:
        return JSONResponse({"status": "ok", "data": [{"id": "m", "object": "model"}]})

    async def fail(request: Any) -> Response:
        err = {"error": {"message": "overloaded", "type": "x", "param": None, "code": None}}
        return JSONResponse(err, status_code=503)

    return Starlette(
        routes=[
            Route("/health", ok),
            Route("/v1/models", ok),
            Route("/metrics", lambda request: Response("")),
            Route("/v1/completions", fail, methods=["POST"]),
        ]
    )


def wait_for(url: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not answers_ok(url, 2.0):
        assert time.monotonic() < end, f"{url} did not answer in {timeout} s"
        time.sleep(0.1)


@contextmanager
def served(app: Any, port: int) -> Iterator[str]:
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def traced(llama_dir) -> Iterator[tuple[str, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    replica_port, broken_port, gw_port = free_port(), free_port(), free_port()
    replica = create_app(
        ServerSettings(model=str(llama_dir), served_model_name="m", port=replica_port),
        tracer_provider=provider,
    )
    gateway_settings = GatewaySettings.model_validate(
        {
            "port": gw_port,
            "models": {
                # A backend that passes its checks but answers 503: a request that tries it
                # first is retried on the replica.
                "m": {
                    "backends": [
                        {"url": f"http://127.0.0.1:{broken_port}"},
                        {"url": f"http://127.0.0.1:{replica_port}"},
                    ]
                }
            },
            "health": {"interval_s": 60, "timeout_s": 5, "generate_probe": False},
            "breaker": {"min_calls": 1000},
            "ejection": {"consecutive_failures": 1000},
            "retry": {"max_retries": 2, "base_s": 0.001, "cap_s": 0.002},
        }
    )
    gateway = create_gateway_app(gateway_settings, tracer_provider=provider)
    with (
        served(replica, replica_port) as replica_url,
        served(broken_backend(), broken_port),
    ):
        wait_for(replica_url + "/ready", 120)
        with served(gateway, gw_port) as gw_url:
            wait_for(gw_url + "/ready", 30)
            yield gw_url, exporter
    provider.shutdown()


def spans_of(exporter: InMemorySpanExporter, trace_id: int, want: int, timeout: float = 10):
    end = time.monotonic() + timeout
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        if len(spans) >= want or time.monotonic() > end:
            return spans
        time.sleep(0.05)


def test_one_trace_spans_gateway_and_replica_with_genai_attributes(traced):
    url, exporter = traced
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "m", "prompt": "Hello there", "max_tokens": 5, "temperature": 0},
        headers={"traceparent": TRACEPARENT},
        timeout=60,
    )
    assert r.status_code == 200
    spans = spans_of(exporter, CLIENT_TRACE, want=7)
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    root = by_name["gateway /v1/completions"][0]
    assert root.parent is not None and root.parent.span_id == int("b7ad6b7169203331", 16)
    assert root.attributes["gen_ai.request.model"] == "m"
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.usage.output_tokens"] == 5
    assert root.attributes["http.response.status_code"] == 200
    assert "gateway admission" in by_name
    attempts = by_name["gateway upstream attempt"]
    served_by = [a for a in attempts if a.attributes["poise.outcome"] == "ok"]
    assert len(served_by) == 1
    replica = by_name["replica /v1/completions"][0]
    # The replica continues the gateway's trace under the attempt that reached it.
    assert replica.parent.span_id == served_by[0].context.span_id
    assert replica.attributes["gen_ai.usage.input_tokens"] > 0
    assert replica.attributes["gen_ai.usage.output_tokens"] == 5
    assert replica.attributes["gen_ai.response.finish_reasons"] == ("length",)
    for phase in ("replica queue", "replica prefill", "replica decode"):
        (span,) = by_name[phase]
        assert span.parent.span_id == replica.context.span_id
        assert span.start_time <= span.end_time
    # No prompt text anywhere unless asked for.
    assert not any("Hello there" in str(v) for s in spans for v in s.attributes.values())


def test_a_failed_attempt_and_its_retry_are_spans_of_the_same_trace(traced):
    url, exporter = traced
    for i in range(8):  # the pick is random; some request's first attempt hits the dead backend
        parent = f"00-{i + 1:032x}-b7ad6b7169203331-01"
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "m", "prompt": f"retry me {i}", "max_tokens": 2, "temperature": 0},
            headers={"traceparent": parent},
            timeout=60,
        )
        assert r.status_code == 200
        spans = spans_of(exporter, i + 1, want=7)
        attempts = sorted(
            (s for s in spans if s.name == "gateway upstream attempt"),
            key=lambda s: s.start_time,
        )
        if len(attempts) < 2:
            continue
        first, retry = attempts[0], attempts[1]
        assert first.attributes["poise.outcome"] == "error"
        assert first.attributes["poise.retry"] == 0 and retry.attributes["poise.retry"] == 1
        assert first.attributes["poise.backend"] != retry.attributes["poise.backend"]
        assert retry.attributes["poise.outcome"] == "ok"
        root = next(s for s in spans if s.name == "gateway /v1/completions")
        assert root.attributes["poise.retries"] == 1
        assert all(a.parent.span_id == root.context.span_id for a in attempts)
        return
    pytest.fail("no request's first attempt went to the broken backend in 8 tries")


class Collector(ThreadingHTTPServer):
    """A minimal OTLP/HTTP trace receiver: keeps every exported span."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, bytes]] = []  # (service, span name, trace id)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    service = next(
                        a.value.string_value
                        for a in rs.resource.attributes
                        if a.key == "service.name"
                    )
                    for ss in rs.scope_spans:
                        outer.spans += [(service, s.name, s.trace_id) for s in ss.spans]
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", free_port()), Handler)


def test_spans_reach_an_otlp_collector_from_real_processes(llama_dir, tmp_path):
    collector = Collector()
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    replica = ServerProcess(llama_dir, tmp_path, "--otlp-endpoint", endpoint)
    gateway = None
    try:
        gateway = GatewayProcess(
            {
                "models": {"m": {"backends": [{"url": replica.url}]}},
                "otlp_endpoint": endpoint,
                "health": {"generate_probe": False},
            },
            tmp_path,
        )
        r = httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "m", "prompt": "to the collector", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200
    finally:
        if gateway is not None:
            gateway.stop()  # a clean stop flushes the batched spans
        replica.stop()
        collector.shutdown()
        collector.server_close()
    roots = [s for s in collector.spans if s[1] == "gateway /v1/completions"]
    assert len(roots) == 1 and roots[0][0] == "poise-gateway"
    same_trace = {(svc, name) for svc, name, tid in collector.spans if tid == roots[0][2]}
    assert ("poise-replica", "replica /v1/completions") in same_trace
    assert ("poise-replica", "replica decode") in same_trace
