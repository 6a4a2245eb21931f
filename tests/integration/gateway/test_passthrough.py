"""Every other backend route through a real gateway: embeddings, the Responses API, audio,
``/tokenize``... forwarded as they came.

The gateway runs in this process (uvicorn on loopback) in front of small aiohttp backends that
record what reached them and answer routes a poise replica does not serve: what each test looks
at is what crossed the wire both ways. All of it runs on one event loop in a thread of its own;
the tests drive it with plain HTTP clients.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn
from aiohttp import web

from gatewayproc import gateway_metric
from poise.asgi import uvicorn_config
from poise.gateway.app import create_gateway_app
from poise.gateway.config import GatewaySettings
from poise.launcher import free_port

T = TypeVar("T")
NOT_FOUND = {"error": {"message": "no such route", "type": "invalid_request_error",
                       "param": None, "code": "not_found"}}  # fmt: skip
EMBEDDING = {
    "object": "list",
    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
    "usage": {"prompt_tokens": 3, "total_tokens": 3},
}
EVENTS = [b'event: response.created\ndata: {"type": "response.created"}\n\n',
          b'event: response.output_text.delta\ndata: {"delta": "hi"}\n\n',
          b'event: response.completed\ndata: {"type": "response.completed"}\n\n']  # fmt: skip


@dataclass
class Seen:
    method: str
    path: str  # with its query
    headers: dict[str, str]  # names in lower case
    body: bytes


@dataclass
class Backend:
    """A backend on loopback that records each request and answers by route: ``fail`` routes
    with a 500, ``drop`` routes by closing the connection once the request is read, and the
    rest with an embedding, an event stream (a streamed /v1/responses, or ``?stream=true``),
    a 404 in OpenAI's shape (``/v1/nothing``) or an echo of what it received."""

    name: str
    seen: list[Seen] = field(default_factory=list)
    fail: set[str] = field(default_factory=set)
    drop: set[str] = field(default_factory=set)
    event_gap_s: float = 0.0
    url: str = ""
    runner: web.AppRunner | None = None

    def calls(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path.split("?")[0] == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        if path in ("/health", "/metrics", "/v1/models"):  # the gateway's checks
            return web.json_response({"status": "ok"}) if path != "/metrics" else web.Response()
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.seen.append(Seen(request.method, request.path_qs, headers, body))
        if path in self.fail:
            error = {"error": {"message": f"{self.name} failed", "type": "server_error"}}
            return web.json_response(error, status=500)
        if path in self.drop:
            assert request.transport is not None
            request.transport.abort()  # the request arrived; no answer ever will
            return web.Response()
        if path == "/v1/embeddings":
            return web.json_response({**EMBEDDING, "backend": self.name})
        if path == "/v1/nothing":
            return web.json_response(NOT_FOUND, status=404)
        asked = path == "/v1/responses" and body and json.loads(body).get("stream")
        if asked or request.query.get("stream") == "true":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for event in EVENTS:
                await response.write(event)
                await asyncio.sleep(self.event_gap_s)
            await response.write_eof()
            return response
        echo = {"backend": self.name, "method": request.method, "path": request.path_qs}
        return web.json_response(echo, status=201 if request.method == "POST" else 200)

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        """Stop listening: the port now refuses connections."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


class Loop:
    """An event loop in a thread of its own, for the servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 15) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@dataclass
class Gateway:
    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]

    def metric(self, name: str, **labels: str) -> float:
        return gateway_metric(self.url, name, **labels)


Start = Callable[..., tuple[Gateway, list[Backend], list[Backend]]]

# Failures never take a backend out during a test: each one shows what one attempt did.
STEADY = {
    "health": {"interval_s": 30, "timeout_s": 2, "healthy_after": 1, "unhealthy_after": 1},
    "breaker": {"min_calls": 1000},
    "ejection": {"consecutive_failures": 1000},
    "retry": {"max_retries": 2, "base_s": 0.0, "cap_s": 0.0},
    "slow_ejection": {"enabled": False},
}


@pytest.fixture
def start() -> Iterator[Start]:
    """``start(m=[weights], other=[weights], **settings)``: backends for models "m" (listed
    first: the default) and "other", and a gateway before them. A heavier backend is always
    tried first (the router compares load over weight), so a test knows where each attempt goes.
    """
    loop = Loop()
    started: list[tuple[Gateway, list[Backend]]] = []

    def start_(
        m: tuple[float, ...] = (1.0,), other: tuple[float, ...] = (1.0,), **settings: Any
    ) -> tuple[Gateway, list[Backend], list[Backend]]:
        pools = {"m": [Backend(f"m{i}") for i in range(len(m))],
                 "other": [Backend(f"other{i}") for i in range(len(other))]}  # fmt: skip
        for b in pools["m"] + pools["other"]:
            loop.run(b.start())
        weights = {"m": m, "other": other}
        config = {
            "models": {
                name: {"backends": [{"url": b.url, "weight": w, "kind": "openai"}
                                    for b, w in zip(bs, weights[name], strict=True)]}
                for name, bs in pools.items()
            },
            **STEADY,
            **settings,
        }  # fmt: skip
        app = create_gateway_app(GatewaySettings.model_validate(config))
        port = free_port()
        server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning"))

        async def serve() -> asyncio.Task[None]:
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.01)
            return task

        g = Gateway(f"http://127.0.0.1:{port}", server, loop.run(serve()))
        started.append((g, pools["m"] + pools["other"]))
        end = time.monotonic() + 10
        while httpx.get(g.url + "/ready").status_code != 200:  # every backend checked
            assert time.monotonic() < end
            time.sleep(0.02)
        return g, pools["m"], pools["other"]

    yield start_
    for g, backends in started:
        g.server.should_exit = True
        loop.run(asyncio.wait_for(g.task, 10))
        for b in backends:
            loop.run(b.stop())
    loop.close()


def run_in(loop_of: Gateway, coro: Awaitable[T]) -> T:
    return asyncio.run_coroutine_threadsafe(coro, loop_of.task.get_loop()).result(10)  # type: ignore[arg-type]


def test_a_json_route_passes_with_its_body_status_and_headers(start: Start):
    g, (m,), (other,) = start()
    body = b'{"model": "other", "input": "three tokens",   "encoding_format": "float"}'
    r = httpx.post(
        g.url + "/v1/embeddings",
        content=body,
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-client",
                 "OpenAI-Beta": "assistants=v2", "x-poise-stream-tokens": "1"},
    )  # fmt: skip
    assert r.status_code == 200 and r.json() == {**EMBEDDING, "backend": "other0"}
    (seen,) = other.seen
    assert not m.seen  # the body's model chose the pool
    assert (seen.method, seen.path, seen.body) == ("POST", "/v1/embeddings", body)  # as it came
    h = seen.headers
    assert h["content-type"] == "application/json" and h["openai-beta"] == "assistants=v2"
    # The gateway's own: its deadline, the request's id; not the client's key, nor poise's
    # internal headers from a client.
    assert int(h["x-request-deadline-ms"]) > 0 and h["x-request-id"] == r.headers["x-request-id"]
    assert "authorization" not in h and "x-poise-stream-tokens" not in h

    # Any method and a query, and the backend's own status; a route it does not serve stays
    # its 404, in OpenAI's shape as it sent it.
    files = "/v1/files?purpose=batch&limit=2"
    r = httpx.get(g.url + files)
    assert r.status_code == 200 and r.json() == {"backend": "m0", "method": "GET", "path": files}
    r = httpx.delete(g.url + "/v1/responses/resp_123")
    assert r.status_code == 200 and r.json()["method"] == "DELETE"
    r = httpx.post(g.url + "/tokenize", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 201 and r.json()["path"] == "/tokenize"
    r = httpx.post(g.url + "/v1/nothing", json={"model": "m"})
    assert r.status_code == 404 and r.json() == NOT_FOUND
    # The gateway's own routes come first: /v1/models is never the backend's.
    assert [d["id"] for d in httpx.get(g.url + "/v1/models").json()["data"]] == ["m", "other"]
    paths = [files, "/v1/responses/resp_123", "/tokenize", "/v1/nothing"]
    assert [s.path for s in m.seen] == paths


def test_a_multipart_body_goes_byte_for_byte_to_the_model_it_names(start: Start):
    g, (m,), (other,) = start()
    audio = bytes(range(256)) * 64  # binary, with every byte value and CRLFs in it
    files = {"file": ("speech.wav", audio, "audio/wav")}
    request = httpx.Request(
        "POST", g.url + "/v1/audio/transcriptions", data={"model": "other"}, files=files
    )
    sent = request.read()
    with httpx.Client() as client:
        r = client.send(request)
    assert r.status_code == 201 and r.json()["backend"] == "other0"
    (seen,) = other.seen
    assert seen.body == sent and seen.headers["content-type"] == request.headers["content-type"]
    # No model field: the default model, the first configured.
    r = httpx.post(g.url + "/v1/audio/translations", files=files)
    assert r.status_code == 201 and r.json()["backend"] == "m0"
    # Any other type too, as it came.
    r = httpx.post(g.url + "/v1/uploads/x/parts", content=audio,
                   headers={"Content-Type": "application/octet-stream"})  # fmt: skip
    assert r.status_code == 201 and m.seen[-1].body == audio
    assert m.seen[-1].headers["content-type"] == "application/octet-stream"


def test_an_idempotent_route_is_retried_on_the_other_backend(start: Start):
    g, (failing, good), _ = start(m=(100.0, 1.0))  # every request meets the failing one first
    failing.fail.add("/v1/embeddings")
    failing.drop.add("/tokenize")
    for _ in range(3):
        r = httpx.post(g.url + "/v1/embeddings", json={"model": "m", "input": "x"})
        assert r.status_code == 200 and r.json()["backend"] == "m1"
        assert r.headers["x-poise-attempt-count"] == "2"
        r = httpx.post(g.url + "/tokenize", json={"model": "m", "prompt": "x"})
        assert r.status_code == 201 and r.json()["backend"] == "m1"
        r = httpx.get(g.url + "/v1/files")
        assert r.status_code == 200 and r.json()["backend"] == "m0"
    assert len(failing.calls("/v1/embeddings")) == len(good.calls("/v1/embeddings")) == 3
    assert len(failing.calls("/tokenize")) == len(good.calls("/tokenize")) == 3


def test_a_call_that_may_change_state_is_never_sent_twice(start: Start):
    g, (failing, good), _ = start(m=(100.0, 1.0))
    failing.fail.add("/v1/responses")
    failing.drop.add("/v1/audio/speech")
    for _ in range(3):
        # The backend's 500 is the client's answer, its body as it was.
        r = httpx.post(g.url + "/v1/responses", json={"model": "m", "input": "x"})
        assert r.status_code == 500 and r.json()["error"]["message"] == "m0 failed"
        # Accepted, then the connection dropped: it may have acted, so no other backend is asked.
        r = httpx.post(g.url + "/v1/audio/speech", json={"model": "m", "input": "x"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
    assert len(failing.calls("/v1/responses")) == len(failing.calls("/v1/audio/speech")) == 3
    assert not good.seen


def test_a_refused_connection_is_retried_for_any_call(start: Start):
    g, (dead, good), _ = start(m=(100.0, 1.0))
    run_in(g, dead.stop())  # checked healthy, now refusing: the router still picks it first
    for path in ("/v1/responses", "/v1/embeddings"):
        r = httpx.post(g.url + path, json={"model": "m", "input": "x"})
        assert r.status_code in (200, 201) and r.json()["backend"] == "m1", r.text
    assert g.metric("poise_gateway_upstream_attempts_total", backend=dead.url,
                    outcome="connect_error") == 2  # fmt: skip
    assert len(good.seen) == 2


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/responses", {"model": "m", "input": "x", "stream": True}),
        ("GET", "/v1/responses/resp_1?stream=true", None),  # the request does not say it streams
    ],
)
def test_an_event_stream_is_relayed_as_it_comes(
    start: Start, method: str, path: str, body: dict[str, Any] | None
):
    g, (m,), _ = start()
    m.event_gap_s = 0.3
    t0 = time.perf_counter()
    with httpx.stream(method, g.url + path, json=body) as r:
        chunks = [(time.perf_counter() - t0, c) for c in r.iter_raw()]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert b"".join(c for _, c in chunks) == b"".join(EVENTS)  # nothing added, no [DONE]
    # Relayed as they come: the first event arrives well before the last (two 0.3 s gaps);
    # buffered, they would arrive together. Relative, so a loaded machine's delays cancel.
    assert chunks[-1][0] - chunks[0][0] > 0.4


def test_an_oversized_body_is_refused_before_it_is_forwarded(start: Start):
    g, (m,), _ = start(max_body_bytes=4096)
    files = {"file": ("a.wav", b"\0" * 3000, "audio/wav")}
    assert httpx.post(g.url + "/v1/audio/transcriptions", files=files).status_code == 201
    files = {"file": ("a.wav", b"\0" * 5000, "audio/wav")}
    r = httpx.post(g.url + "/v1/audio/transcriptions", files=files)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: refused as it arrives
        yield b"x" * 3000
        yield b"x" * 3000

    r = httpx.request("DELETE", g.url + "/v1/files/f", content=chunked())
    assert r.status_code == 413
    assert len(m.seen) == 1


def test_keys_limits_and_models_hold_as_on_the_completions_routes(start: Start):
    keys = [{"key": "sk-limited-1", "name": "limited", "requests_per_minute": 2}]
    g, (m,), _ = start(keys=keys)
    body = {"model": "m", "input": "x"}
    assert httpx.post(g.url + "/v1/embeddings", json=body).status_code == 401
    bad = {"Authorization": "Bearer sk-nobody-00"}
    assert httpx.post(g.url + "/tokenize", json=body, headers=bad).status_code == 401
    auth = {"Authorization": "Bearer sk-limited-1"}
    r = httpx.post(g.url + "/v1/embeddings", json={"model": "nope"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    statuses = [httpx.post(g.url + "/v1/embeddings", json=body, headers=auth) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    assert statuses[0].headers["x-ratelimit-remaining-requests"] == "1"
    assert len(m.seen) == 2


def test_metrics_count_each_route(start: Start):
    g, _, (other,) = start()
    other.fail.add("/v1/responses")
    for _ in range(2):
        httpx.post(g.url + "/v1/embeddings", json={"model": "other", "input": "x"})
    httpx.post(g.url + "/v1/responses", json={"model": "other", "input": "x"})
    httpx.get(g.url + "/v1/responses/resp_42abc")
    httpx.post(g.url + "/v1/embeddings", json={"model": "nope"})
    count = lambda **labels: g.metric("poise_gateway_requests_total", **labels)  # noqa: E731
    assert count(route="/v1/embeddings", model="other", backend=other.url, outcome="ok") == 2
    assert count(route="/v1/responses", model="other", outcome="upstream_error") == 1
    assert count(route="/v1/responses/{id}", model="m", outcome="ok") == 1  # an id is no label
    assert count(route="/v1/embeddings", outcome="client_error") == 1
    assert g.metric("poise_gateway_request_duration_seconds_count", route="/v1/embeddings") == 2


@pytest.mark.parametrize(
    "path",
    [
        "/v1/../debug/state",
        "/v1/%2e%2e/admin/faults",
        "/v1/models/../../version",
        "/v1/./../metrics",
        "/v1//embeddings",
        "/v1/./chat/completions",
    ],
)
def test_a_path_that_climbs_out_of_v1_reaches_no_backend(start: Start, path: str):
    """The URL sent to a backend would resolve dot segments: such a path would reach the
    replica's own routes carrying the gateway's key to it. Sent raw (httpx would resolve)."""
    g, (m,), _ = start()
    host, port = g.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(
            "POST", path, body=b'{"model": "m"}', headers={"Content-Type": "application/json"}
        )
        status = conn.getresponse().status
    finally:
        conn.close()
    assert status == 404
    assert m.seen == []
