"""``LocalDeployment.scale_to``: a replica leaves the gateway's rotation before its SIGTERM, and
comes back through the gateway after it is started again; without a gateway it is stopped
anyway, after a bounded wait.

Replicas and the gateway are stand-in processes (``sleep``); the gateway's admin routes are a
small HTTP server that records what it was asked and whether the replica was still running."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from poise import launcher
from poise.launcher import Child, GatewayAdmin, LocalDeployment, free_port

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class FakeAdmin:
    def __init__(self, deployment: LocalDeployment) -> None:
        self.calls: list[tuple[str, dict[str, Any], bool]] = []  # path, body, replica alive
        self.status = 200
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                child = deployment.replicas[deployment.replica_urls.index(body["url"])]
                alive = child.proc is not None and child.proc.poll() is None
                outer.calls.append((self.path, body, alive))
                out = json.dumps({"url": body["url"], "inflight": 0}).encode()
                self.send_response(outer.status)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[LocalDeployment]:
    ports = [free_port(), free_port()]
    d = LocalDeployment(
        [Child(f"replica-{i}", SLEEPER) for i in range(2)],
        ports,
        Child("gateway", SLEEPER),
        "http://unused",
        tmp_path / "gateway.yaml",
    )
    d.start(1)
    try:
        yield d
    finally:
        for child in [*d.replicas, d.gateway]:
            child.stop(5)


def test_scale_down_takes_the_replica_out_at_the_gateway_before_its_sigterm(deployment):
    admin = FakeAdmin(deployment)
    deployment.admin = GatewayAdmin(admin.url, "m", "sk-key")
    try:
        said = deployment.scale_to(2)
        second = deployment.replicas[1]
        assert "replica-1 started (scale up to 2)" in said
        assert any("back in the gateway's rotation" in line for line in said), said
        assert [(p, b["url"]) for p, b, _ in admin.calls] == [
            ("/admin/backends/restore", deployment.replica_urls[1])
        ]
        said = deployment.scale_to(1)
        path, body, alive = admin.calls[-1]
        assert path == "/admin/backends/drain" and body["model"] == "m" and body["wait_s"] > 0
        assert alive, "the gateway was asked only after the SIGTERM"
        assert said == [
            "replica-1 out of the gateway's rotation (0 request(s) still on it)",
            "replica-1 draining (scale down to 1)",
        ]
        assert second.proc is not None and second.proc.wait(5) != 0  # the SIGTERM came after
        # Started again: put back at the gateway.
        deployment.scale_to(2)
        assert admin.calls[-1][0] == "/admin/backends/restore"
        assert second.proc.poll() is None
    finally:
        admin.close()


def test_without_an_answer_from_the_gateway_the_replica_is_stopped_after_a_bounded_wait(
    deployment, monkeypatch
):
    monkeypatch.setattr(launcher, "TAKE_OUT_S", 0.5)
    deployment.admin = GatewayAdmin(f"http://127.0.0.1:{free_port()}", "m")  # nobody there
    said = deployment.scale_to(2)
    assert any("did not put it back yet" in line for line in said), said
    assert deployment.replicas[1].restore_pending
    t0 = time.monotonic()
    said = deployment.scale_to(1)
    assert time.monotonic() - t0 < 2.0
    assert "did not take it out within 0.5s" in said[0] and "stopping it anyway" in said[0]
    proc = deployment.replicas[1].proc
    assert proc is not None and proc.wait(5) != 0
    assert not deployment.replicas[1].restore_pending


def test_a_restore_the_gateway_refused_is_asked_again_by_supervise(deployment, monkeypatch):
    monkeypatch.setattr(launcher, "TAKE_OUT_S", 0.5)
    admin = FakeAdmin(deployment)
    deployment.admin = GatewayAdmin(admin.url, "m")
    try:
        admin.status = 503
        deployment.scale_to(2)
        assert deployment.replicas[1].restore_pending
        admin.status = 200
        deployment._next_restore = 0.0
        said = deployment.supervise()
        assert any("back in the gateway's rotation" in line for line in said), said
        assert not deployment.replicas[1].restore_pending
    finally:
        admin.close()
