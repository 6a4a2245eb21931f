"""``/admin/backends``: a drained backend takes no new attempt from the moment the answer comes,
what it holds finishes, and a restored one comes back only through a passing health check.

The backends are small HTTP servers in threads; the gateway runs in this process."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from starlette.testclient import TestClient

from poise.gateway.app import create_gateway_app
from poise.gateway.config import GatewaySettings
from poise.gateway.discovery import Resolver, resolve


class FakeBackend:
    """Answers /health (200 while ``up``), /metrics, and completions after ``delay_s``."""

    def __init__(self) -> None:
        self.up = True
        self.draining = False  # /health answers as a poise replica after SIGTERM
        self.delay_s = 0.0
        self.completions = 0
        self.received: list[tuple[dict[str, str], dict[str, Any]]] = []  # headers, body
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path.startswith("/health") and outer.draining:
                    self._send(503, b'{"status": "draining", "reason": "SIGTERM"}')
                elif self.path.startswith("/health"):
                    self._send(200 if outer.up else 503, b"{}")
                else:
                    self._send(200, b"", "text/plain")

            def do_POST(self) -> None:
                sent = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.received.append((dict(self.headers.items()), json.loads(sent or b"{}")))
                outer.completions += 1
                time.sleep(outer.delay_s)
                body = {
                    "id": "c",
                    "object": "text_completion",
                    "created": 1,
                    "model": "m",
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
                self._send(200, json.dumps(body).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@contextmanager
def gateway(
    n: int,
    dns: list[dict[str, Any]] | None = None,
    resolver: Resolver = resolve,
    client: tuple[str, int] = ("127.0.0.1", 50000),
    **extra: Any,
) -> Iterator[tuple[TestClient, list[FakeBackend]]]:
    """``n`` listed backends, and ``dns`` entries answered by ``resolver``; requests come
    from ``client`` (loopback: as poise up on the same host)."""
    backends = [FakeBackend() for _ in range(n)]
    settings = GatewaySettings.model_validate(
        {
            "models": {
                "m": {
                    "backends": [{"url": b.url, "kind": "poise"} for b in backends]
                    + [{"kind": "poise", **d} for d in dns or []]
                }
            },
            "health": {"interval_s": 0.05, "timeout_s": 1.0, "generate_probe": False},
            **extra,
        }
    )
    try:
        app = create_gateway_app(settings, resolver=resolver)
        with TestClient(app, client=client) as test_client:
            yield test_client, backends
    finally:
        for b in backends:
            b.close()


def until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def eligible(client: TestClient, headers: dict[str, str] | None = None) -> list[str]:
    """The backends routed to that an active check has seen serving (a listed backend is
    eligible before its first check)."""
    model = client.get("/debug/state", headers=headers).json()["models"]["m"]
    checked = {b["url"] for b in model["backends"] if b["checked"]}
    return [url for url in model["eligible"] if url in checked]


def complete(client: TestClient) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})


def test_a_drained_backend_gets_no_new_request_and_comes_back_only_through_its_checks():
    with gateway(2, health={"interval_s": 0.05, "timeout_s": 1.0, "generate_probe": False,
                            "healthy_after": 2}) as (client, (a, b)):  # fmt: skip
        assert until(lambda: sorted(eligible(client)) == sorted([a.url, b.url]))
        r = client.post("/admin/backends/drain", json={"model": "m", "url": b.url + "/"})
        assert r.status_code == 200, r.text
        assert r.json() == {"model": "m", "url": b.url, "kind": "poise", "draining": True,
                            "healthy": True, "checked": True, "eligible": False,
                            "inflight": 0}  # fmt: skip
        before = b.completions
        assert all(complete(client).status_code == 200 for _ in range(20))
        assert b.completions == before and a.completions >= 20
        state = client.get("/admin/backends").json()["models"]["m"]
        assert [s["draining"] for s in state] == [False, True]
        assert client.get("/debug/state").json()["models"]["m"]["backends"][1]["draining"]

        # Restored while its replica is still down: out until a check passes.
        b.up = False
        r = client.post("/admin/backends/restore", json={"model": "m", "url": b.url})
        assert r.status_code == 200, r.text
        assert r.json()["draining"] is False and r.json()["eligible"] is False
        time.sleep(0.3)  # several failed rounds
        assert eligible(client) == [a.url]
        assert all(complete(client).status_code == 200 for _ in range(5))
        assert b.completions == before
        b.up = True
        assert until(lambda: sorted(eligible(client)) == sorted([a.url, b.url]))
        assert until(lambda: complete(client).status_code == 200 and b.completions > before)


def test_what_a_drained_backend_holds_finishes_and_the_answer_can_wait_for_it():
    with gateway(1) as (client, (a,)):
        assert until(lambda: eligible(client) == [a.url])
        a.delay_s = 0.5
        statuses: list[int] = []
        worker = threading.Thread(target=lambda: statuses.append(complete(client).status_code))
        worker.start()
        assert until(lambda: a.completions == 1)
        r = client.post("/admin/backends/drain", json={"model": "m", "url": a.url})
        assert r.json()["draining"] is True and r.json()["inflight"] == 1
        # Asked again with a wait: answers once the gateway holds nothing there.
        t0 = time.monotonic()
        r = client.post("/admin/backends/drain", json={"model": "m", "url": a.url, "wait_s": 5})
        assert r.json()["inflight"] == 0 and time.monotonic() - t0 < 2.0
        worker.join()
        assert statuses == [200]
        # Nothing else in the pool: a new request finds no backend, and none reaches this one.
        assert complete(client).status_code == 503
        assert a.completions == 1


def test_a_backend_that_says_it_is_draining_leaves_rotation_but_keeps_what_it_holds():
    """A replica drained by its own SIGTERM (no admin call first: an operator, a timed-out
    drain, Kubernetes) fails its probes saying so: the gateway stops sending it work, and the
    request it holds finishes there instead of being cut off and sent again elsewhere."""
    with gateway(2) as (client, (a, b)):
        assert until(lambda: sorted(eligible(client)) == sorted([a.url, b.url]))
        a.delay_s = b.delay_s = 1.0
        statuses: list[int] = []
        worker = threading.Thread(target=lambda: statuses.append(complete(client).status_code))
        worker.start()
        assert until(lambda: a.completions + b.completions == 1)
        holder = a if a.completions else b
        other = b if holder is a else a
        holder.draining = True
        assert until(lambda: eligible(client) == [other.url], timeout=0.9)
        worker.join()
        assert statuses == [200]
        assert holder.completions == 1 and other.completions == 0  # finished where it was
        other.delay_s = 0.0
        assert complete(client).status_code == 200 and other.completions == 1


def test_the_admin_routes_are_guarded_by_the_keys_and_name_what_is_wrong():
    key = {"key": "sk-admin-key-1", "name": "ops"}
    with gateway(1, keys=[key]) as (client, (a,)):
        ref = {"model": "m", "url": a.url}
        assert client.post("/admin/backends/drain", json=ref).status_code == 401
        assert client.get("/admin/backends").status_code == 401
        auth = {"authorization": f"Bearer {key['key']}"}
        assert client.get("/admin/backends", headers=auth).status_code == 200
        r = client.post("/admin/backends/drain", json={"model": "x", "url": a.url}, headers=auth)
        assert r.status_code == 404 and "unknown model" in r.json()["error"]["message"]
        r = client.post("/admin/backends/restore", json={"model": "m", "url": "http://nowhere:1"},
                        headers=auth)  # fmt: skip
        assert r.status_code == 404
        r = client.post("/admin/backends/drain", json={"model": "m"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "url"
        r = client.post("/admin/backends/drain", content=b"{not json", headers=auth)
        assert r.status_code == 400
        r = client.post("/admin/backends/drain", json=ref, headers=auth)
        assert r.status_code == 200 and r.json()["draining"] is True


def test_a_backend_dropped_while_drained_is_listed_again_and_a_discovered_one_is_refused():
    extra = FakeBackend()
    port = int(extra.url.rsplit(":", 1)[1])

    async def resolver(host: str, p: int) -> list[str]:
        return ["127.0.0.1"]

    dns = [{"url": f"http://replicas.test:{port}", "discovery": "dns", "dns_refresh_s": 0.05}]
    try:
        with gateway(1, dns=dns, resolver=resolver) as (client, (a,)):
            assert until(lambda: sorted(eligible(client)) == sorted([a.url, extra.url]))
            # A discovered backend is DNS's to add and remove.
            r = client.post("/admin/backends/drain", json={"model": "m", "url": extra.url})
            assert r.status_code == 409 and "DNS" in r.json()["error"]["message"]
            # A listed one, drained and idle, is swept with the pool's retired backends...
            assert client.post("/admin/backends/drain", json={"model": "m", "url": a.url}).json()[
                "draining"
            ]

            def urls() -> list[str]:
                return [b["url"] for b in client.get("/admin/backends").json()["models"]["m"]]

            assert until(lambda: urls() == [extra.url])
            # ... and comes back from the config when restored, through its health checks.
            r = client.post("/admin/backends/restore", json={"model": "m", "url": a.url})
            assert r.status_code == 200 and r.json()["eligible"] is False
            assert until(lambda: sorted(eligible(client)) == sorted([a.url, extra.url]))
    finally:
        extra.close()


def test_only_an_admin_key_may_drain_from_another_host():
    keys = [
        {"key": "sk-tenant-1", "name": "tenant"},
        {"key": "sk-operator", "name": "operator", "admin": True},
    ]
    with gateway(2, client=("10.1.2.3", 40000), keys=keys) as (client, backends):
        body = {"model": "m", "url": backends[0].url}
        tenant = {"authorization": "Bearer sk-tenant-1"}
        # Its first check first (a loaded machine may not have run it yet).
        assert until(lambda: backends[0].url in eligible(client, headers=tenant))
        r = client.post("/admin/backends/drain", json=body, headers=tenant)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        assert backends[0].url in eligible(client, headers=tenant)  # nothing changed
        operator = {"authorization": "Bearer sk-operator"}
        assert client.post("/admin/backends/drain", json=body, headers=operator).status_code == 200
        assert backends[0].url not in eligible(client, headers=tenant)


def test_loopback_is_recognised_in_every_spelling_and_nothing_else_is():
    from poise.gateway.app import _is_loopback

    for host in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1", "localhost"):
        assert _is_loopback(host), host
    for host in ("10.1.2.3", "::ffff:10.1.2.3", "fe80::1", "", "testclient", "127.0.0.1.evil"):
        assert not _is_loopback(host), host


def test_an_admin_body_is_read_by_the_strict_rules_and_refused_in_openais_shape():
    # Read leniently, a deeply nested body was a RecursionError: a plain-text 500 and a dropped
    # connection; NaN and a lone surrogate passed the parser and failed further on.
    with gateway(1) as (client, (a,)):
        for body in (
            b"[" * 100_000 + b"]" * 100_000,
            b'{"model": "m", "url": NaN}',
            b'{"model": "\\ud800", "url": "x"}',
            b'{"model": "m", "url": "\xff"}',
        ):
            for route in ("/admin/backends/drain", "/admin/backends/restore"):
                r = client.post(route, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (route, body[:40], r.text[:200])
                assert r.json()["error"]["code"] == "invalid_body"
        ref = {"model": "m", "url": a.url}
        assert client.post("/admin/backends/drain", json=ref).status_code == 200
