"""Active health checks and load reports, one loop per backend.

A backend of unknown kind is first asked what it is (``backend_kind.detect``); until it answers,
every round fails. Then each round asks, by kind (``backend_kind.Traits``):
- health by a real one-token generation: on a poise replica ``/health?probe=generate``, which
  skips its queue so that the verdict is about the engine and not about how busy it is; on vLLM,
  SGLang, llama-server and TGI a one-token ``/v1/completions`` (their ``/health`` answers 200
  from the HTTP process while the engine under it is stuck); on a hosted ``openai`` backend
  ``/v1/models`` (a generation there is a bill);
- the load the router uses, from the backend's own ``/metrics`` under its kind's names (or
  llama-server's ``/slots``), with its counts of tokens prefilled and generated.

A generation probe of another engine waits in its batch like any request. When it does not
answer in ``timeout_s`` while the backend's counts of tokens went up since the last round, the
backend is busy, not stuck, and the round passes; a stuck engine processes nothing. (On the
first round, with nothing to compare, one that reports running requests gets the benefit of the
doubt for that round.) A failed read of the load fails no round: the load goes stale, which
routing counts as busy. Both take at most ``timeout_s``, side by side, so that a round that
fails ends as soon as its probe does.

A backend is marked down after ``unhealthy_after`` failed rounds and up after ``healthy_after``
good ones. A probe that does not answer within ``timeout_s`` is a failed round: a port that
accepts connections is not health. With the defaults (a round every 0.5 s, 1 s to answer, two
failed rounds) a stopped backend is out within about 3 s, and the work waiting on it is cut off
then (``Backend.cut_off``) so that it moves to another backend instead of waiting on a dead one -
unless the backend said it is draining (a replica after SIGTERM finishes what it holds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from poise.gateway.backend_kind import detect, traits
from poise.gateway.config import HealthSettings
from poise.gateway.load_report import LoadReport, parse_metrics, parse_slots
from poise.gateway.pool import Backend
from poise.resilience.latency import LatencyTracker

log = logging.getLogger("poise.gateway.health")

PROBE_PROMPT = "Hello"
# More tokens than a round's probes process themselves (a short prompt and one token, and the
# last round's, counted late): a count that grew by fewer is no evidence of other work.
PROBE_TOKENS = 16


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
    if backend.kind is None:
        backend.kind = await detect(client, backend.url, headers, cfg.timeout_s)
        if backend.kind is None:
            return False
        log.info("backend %s is %s", backend.url, backend.kind)
    # The probe and the load read side by side: a generation that takes its whole timeout on
    # a busy engine must not leave the load report older than routing trusts.
    before = backend.load.processed
    t0 = clock()
    probed, loaded = await asyncio.gather(
        _probe(client, backend, cfg, headers),
        _load(client, backend, cfg, headers),
        return_exceptions=True,
    )
    if isinstance(probed, BaseException):
        if not isinstance(probed, httpx.HTTPError):
            raise probed
        return False
    ok, timed_out = probed
    generation = cfg.generate_probe and traits(backend.kind).probe != "models"
    if ok and latency is not None and generation:
        # How long a one-token generation took: what lets a backend out for slowness back in
        # (a plain /health is fast on a slow engine too).
        latency.observe_probe(backend.url, clock() - t0)
    if isinstance(loaded, BaseException):
        if not isinstance(loaded, httpx.HTTPError):
            raise loaded
        # No report this round: the load goes stale (routing counts it as busy); the probe
        # alone says whether the backend is up.
        return ok
    if loaded is not None:
        backend.load.waiting = loaded.waiting
        backend.load.running = loaded.running
        backend.load.kv_usage = loaded.kv_usage
        backend.load.processed = loaded.processed
        backend.load.at = clock()  # the pool judges staleness on the same clock
        if timed_out and _busy(before, loaded):
            log.debug("backend %s: probe timed out while it processed tokens: busy", backend.url)
            ok = True
    return ok


async def _probe(
    client: httpx.AsyncClient, backend: Backend, cfg: HealthSettings, headers: dict[str, str]
) -> tuple[bool, bool]:
    """(passed, timed out)."""
    kind = traits(backend.kind)
    try:
        if kind.probe == "models":
            r = await client.get(backend.url + "/v1/models", headers=headers, timeout=cfg.timeout_s)
        elif kind.probe == "poise" or not cfg.generate_probe:
            params = {"probe": "generate"} if cfg.generate_probe and kind.probe == "poise" else None
            r = await client.get(
                backend.url + "/health", params=params, headers=headers, timeout=cfg.timeout_s
            )
        else:
            body = {
                "model": backend.settings.model or backend.model,
                "prompt": PROBE_PROMPT,
                "max_tokens": 1,
                "temperature": 0,
            }
            r = await client.post(
                backend.url + "/v1/completions", json=body, headers=headers, timeout=cfg.timeout_s
            )
    except httpx.TimeoutException:
        backend.draining = False
        return False, True
    body = _json_object(r)
    # A poise replica that took SIGTERM answers {"status": "draining"}.
    backend.draining = r.status_code != 200 and body.get("status") == "draining"
    if kind.probe == "poise" and r.is_success:
        backend.numerics = _deterministic_numerics(body)
    # A refusal for load is an answer from a live engine: routing weighs its load.
    return r.is_success or (r.status_code == 429 and kind.probe != "poise"), False


async def _load(
    client: httpx.AsyncClient, backend: Backend, cfg: HealthSettings, headers: dict[str, str]
) -> LoadReport | None:
    kind = traits(backend.kind)
    if not (kind.waiting or kind.running):
        return None  # nothing to read: its load is the gateway's own count
    timeout = cfg.timeout_s
    m = await client.get(backend.url + "/metrics", headers=headers, timeout=timeout)
    if m.status_code == 200:
        report = parse_metrics(m.text, kind, m.headers.get("content-type", ""))
        if report is not None:
            return report
    if kind.slots:  # llama-server without --metrics still lists its slots
        s = await client.get(backend.url + "/slots", headers=headers, timeout=timeout)
        if s.status_code == 200:
            try:
                return parse_slots(s.json())
            except ValueError:
                return None
    return None


def _busy(before: float | None, report: LoadReport) -> bool:
    """Its token counts went up since the last round by more than the probes' own tokens; on
    the first round (nothing to compare with), it says it is running requests: the benefit of
    the doubt for one round."""
    if report.processed is None:
        return False
    if before is None:
        return report.running > 0
    return report.processed - before > PROBE_TOKENS


def _json_object(response: httpx.Response) -> dict[str, Any]:
    """The answer's JSON object; empty when it is none (a plain-text health answer)."""
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _deterministic_numerics(body: dict[str, Any]) -> str | None:
    """A poise replica in its deterministic mode says so in its health answer, with the
    fingerprint of its arithmetic; None for any other answer."""
    numerics = body.get("numerics")
    if body.get("deterministic") is not True or not isinstance(numerics, str) or not numerics:
        return None
    return numerics


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
        if ok:
            backend.passed_at = clock()
        on_probe(backend, ok)
        changed = apply(backend, ok, cfg)
        if changed is not None:
            log.warning("backend %s is now %s", backend.url, "up" if changed else "down")
            if not changed:
                on_down(backend)
                # What answers there next may be another engine (a redeploy): ask again.
                backend.kind = backend.settings.kind
        await asyncio.sleep(cfg.interval_s)
