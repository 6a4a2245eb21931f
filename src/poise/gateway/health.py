"""Active health checks and load reports, one loop per backend.

Each round asks ``/health`` - with ``?probe=generate`` where enabled, which on a poise replica
runs a real one-token generation that skips the queue, so the verdict is about the engine and
not about how busy it is - and reads ``/metrics`` for the load the router uses (waiting and
running requests, KV usage, under vLLM's names, which poise and vLLM both export). A backend is
marked down after ``unhealthy_after`` failed rounds and up after ``healthy_after`` good ones.
A probe that does not answer within ``timeout_s`` is a failed round: a port that accepts
connections is not health. With the defaults (a round every 0.5 s, 1 s to answer, two failed
rounds) a stopped backend is out within about 3 s, and the work waiting on it is cut off then
(``Backend.cut_off``) so that it moves to another backend instead of waiting on a dead one -
unless the backend said it is draining (a replica after SIGTERM finishes what it holds).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

import httpx

from poise.gateway.config import HealthSettings
from poise.gateway.pool import Backend
from poise.resilience.latency import LatencyTracker

log = logging.getLogger("poise.gateway.health")

_GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
_LINE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


def parse_load(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in _LINE.findall(text):
        field = _GAUGES.get(name)
        if field is not None:
            out[field] = out.get(field, 0.0) + float(value)
    return out


async def check_once(
    client: httpx.AsyncClient,
    backend: Backend,
    cfg: HealthSettings,
    clock: Callable[[], float] = time.monotonic,
    latency: LatencyTracker | None = None,
) -> bool:
    headers = {}
    if backend.settings.api_key:
        headers["authorization"] = f"Bearer {backend.settings.api_key}"
    try:
        params = {"probe": "generate"} if cfg.generate_probe else None
        t0 = clock()
        r = await client.get(
            backend.url + "/health", params=params, headers=headers, timeout=cfg.timeout_s
        )
        ok = r.status_code == 200
        backend.draining = not ok and _says_draining(r)
        if ok and latency is not None and cfg.generate_probe:
            # How long a one-token generation took: what lets a backend out for slowness
            # back in (a plain /health is fast on a slow engine too).
            latency.observe_probe(backend.url, clock() - t0)
        m = await client.get(backend.url + "/metrics", headers=headers, timeout=cfg.timeout_s)
        if m.status_code == 200:
            load = parse_load(m.text)
            backend.load.waiting = load.get("waiting", 0.0)
            backend.load.running = load.get("running", 0.0)
            backend.load.kv_usage = load.get("kv_usage", 0.0)
            backend.load.at = clock()  # the pool judges staleness on the same clock
        return ok
    except httpx.HTTPError:
        return False


def _says_draining(response: httpx.Response) -> bool:
    """A poise replica that took SIGTERM answers ``{"status": "draining"}``."""
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("status") == "draining"


def apply(backend: Backend, ok: bool, cfg: HealthSettings) -> bool | None:
    """Fold one result into the backend's state; returns the new verdict when it changed."""
    if not backend.checked:  # until now an assumption, not a verdict: the first one decides
        backend.checked = True
        backend.health_streak = 0
        if ok != backend.healthy:
            backend.healthy = ok
            return ok
        return None
    if ok == backend.healthy:
        backend.health_streak = 0
        return None
    backend.health_streak += 1
    if backend.health_streak >= (cfg.healthy_after if ok else cfg.unhealthy_after):
        backend.healthy = ok
        backend.health_streak = 0
        return ok
    return None


async def watch(
    client: httpx.AsyncClient,
    backend: Backend,
    cfg: HealthSettings,
    on_probe: Callable[[Backend, bool], None],
    clock: Callable[[], float] = time.monotonic,
    on_down: Callable[[Backend], None] = lambda backend: None,
    latency: LatencyTracker | None = None,
) -> None:
    while True:
        ok = await check_once(client, backend, cfg, clock, latency)
        on_probe(backend, ok)
        changed = apply(backend, ok, cfg)
        if changed is not None:
            log.warning("backend %s is now %s", backend.url, "up" if changed else "down")
            if not changed:
                on_down(backend)
        await asyncio.sleep(cfg.interval_s)
