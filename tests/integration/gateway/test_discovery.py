"""Backends discovered through DNS: one per address, following the name's answer.

Two real replicas listen on the same port of two loopback addresses (127.0.0.1 and 127.0.0.2),
as pods behind a headless Service would; the gateway runs in this process with a resolver
whose answer the test changes, as a cluster's DNS changes when pods come and go."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from poise.asgi import uvicorn_config
from poise.gateway.app import create_gateway_app
from poise.gateway.config import GatewaySettings
from poise.gateway.discovery import address_url, resolve
from poise.launcher import free_port, serve_argv, stop_process, wait_ready

pytestmark = pytest.mark.slow


def test_an_address_becomes_a_url_with_the_template_s_scheme_and_port():
    assert address_url("http://replicas.ns.svc:8000", "10.1.2.3") == "http://10.1.2.3:8000"
    assert address_url("https://replicas/", "fd00::7") == "https://[fd00::7]"
    assert "127.0.0.1" in asyncio.run(resolve("localhost", 80))


@pytest.fixture(scope="module")
def two_addresses(llama_dir, tmp_path_factory) -> Iterator[tuple[int, list[str]]]:
    port = free_port()
    log_dir = tmp_path_factory.mktemp("dns")
    procs = []
    logs = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("POISE_")}
    try:
        for host in ("127.0.0.1", "127.0.0.2"):
            log = (log_dir / f"{host}.log").open("wb")
            logs.append(log)
            argv = serve_argv(str(llama_dir), port, "--host", host, "--served-model-name", "m")
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            procs.append(proc)
            wait_ready(f"http://{host}:{port}/ready", proc, lambda: "", "replica", 120)
        yield port, ["127.0.0.1", "127.0.0.2"]
    finally:
        for proc in procs:
            stop_process(proc, 30)
        for log in logs:
            log.close()


def test_backends_follow_the_dns_answer_and_a_vanished_one_drains(two_addresses):
    port, addresses = two_addresses
    answer: list[str] = [addresses[0]]
    failing = threading.Event()

    async def resolver(host: str, p: int) -> list[str]:
        assert (host, p) == ("replicas.test", port)
        if failing.is_set():
            raise OSError("temporary failure in name resolution")
        return list(answer)

    settings = GatewaySettings.model_validate(
        {
            "models": {"m": {"backends": [{"url": f"http://replicas.test:{port}",
                                           "discovery": "dns", "dns_refresh_s": 0.2}]}},
            "health": {"interval_s": 0.2, "timeout_s": 2.0, "healthy_after": 1,
                       "unhealthy_after": 1},
        }
    )  # fmt: skip
    gport = free_port()
    server = uvicorn.Server(
        uvicorn_config(
            create_gateway_app(settings, resolver=resolver), "127.0.0.1", gport, "warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{gport}"
    urls = [f"http://{a}:{port}" for a in addresses]

    def state() -> tuple[list[str], list[str]]:
        try:
            m = httpx.get(url + "/debug/state", timeout=2).json()["models"]["m"]
        except (httpx.HTTPError, ValueError):
            return [], []
        return [b["url"] for b in m["backends"]], m["trusted"]

    def until(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(0.1)
        return False

    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        body = {"model": "m", "prompt": "discover", "max_tokens": 16, "stream": True}
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                with c.stream("POST", url + "/v1/completions", json=body) as r:
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                ok = r.status_code == 200 and lines[-1] == "data: [DONE]"
                statuses.append(200 if ok and not any('"error"' in ln for ln in lines) else 0)

    try:
        assert until(lambda: state()[1] == urls[:1]), state()
        answer.append(addresses[1])  # a pod came up
        assert until(lambda: sorted(state()[1]) == urls), state()
        worker = threading.Thread(target=load)
        worker.start()
        time.sleep(0.5)
        failing.set()  # DNS trouble: nothing changes
        time.sleep(0.6)
        assert sorted(state()[1]) == urls
        failing.clear()
        answer.remove(addresses[0])  # a pod went away: drained, then dropped
        assert until(lambda: state()[0] == urls[1:]), state()
        time.sleep(0.5)
        stop.set()
        worker.join()
        assert statuses and set(statuses) == {200}
        assert httpx.get(url + "/ready", timeout=2).status_code == 200
    finally:
        stop.set()
        server.should_exit = True
        thread.join(10)
