"""``/admin/backends``: take a listed backend out of rotation before it stops, put it back after.

A backend that is about to be stopped (``poise up --autoscale`` scaling down, an operator's
maintenance) is drained here first: no new attempt goes to it from the moment the answer
comes, while what it already holds - streams included - goes on to its end. Told only by a
SIGTERM, the gateway would learn of the stop from failed health checks and requests, met as
errors and retries. Restoring puts it back as a newly discovered backend enters: out of routing
until a health check has seen it serving.

Guarded more than ``/debug/state`` (``Gateway.authorize_admin``): from this host a valid key
(or none, when the gateway has none) will do; from anywhere else only a key marked ``admin``.
Behind a reverse proxy on the same host every client looks local: give keys there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from poise.gateway.core import GatewayCore
from poise.gateway.pool import Backend, Pool
from poise.protocol import APIError

log = logging.getLogger("poise.gateway.admin")

MAX_WAIT_S = 60.0


class Gateway(GatewayCore, Protocol):
    def watch(self, backend: Backend) -> None:
        """Start the health checks of a backend (again)."""


class BackendRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    url: str
    # drain only: answer once the gateway holds no request on it, or after this long
    wait_s: float = Field(default=0.0, ge=0, le=MAX_WAIT_S)


def parse_ref(body: object) -> BackendRef:
    try:
        return BackendRef.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(400, f"{where}: {first['msg']}", param=where) from exc


def find(gw: Gateway, ref: BackendRef) -> tuple[Pool, Backend | None]:
    pool = gw.pools.get(ref.model)
    if pool is None:
        raise APIError(404, f"unknown model {ref.model!r}", param="model", code="not_found")
    url = ref.url.rstrip("/")
    return pool, next((b for b in pool.backends if b.url == url), None)


def unknown(ref: BackendRef) -> APIError:
    return APIError(
        404, f"no backend {ref.url!r} in model {ref.model!r}", param="url", code="not_found"
    )


def listed_only(backend: Backend) -> None:
    """Refuse a backend found through DNS: it comes and goes with its name's answer (drained,
    discovery would add its address again at once)."""
    if backend.source is not None:
        raise APIError(
            409,
            f"backend {backend.url!r} is discovered through DNS ({backend.source}); it leaves "
            "rotation when its name stops resolving to it",
            param="url",
            code="conflict",
        )


def describe(pool: Pool, backend: Backend) -> dict[str, Any]:
    return {
        "model": pool.model,
        "url": backend.url,
        "kind": backend.kind,
        "draining": backend.retired,
        "healthy": backend.healthy,
        "checked": backend.checked,
        "eligible": backend in pool.eligible(),
        "inflight": backend.inflight,
    }


async def drain(gw: Gateway, ref: BackendRef) -> dict[str, Any]:
    """Out of routing now; then, up to ``wait_s``, until the gateway holds nothing on it."""
    pool, backend = find(gw, ref)
    if backend is None:
        raise unknown(ref)
    listed_only(backend)
    if not backend.retired:
        pool.retire(backend)
        log.warning(
            "backend %s drained by an admin request: out of routing, %d in flight",
            backend.url,
            backend.inflight,
        )
    end = gw.clock() + ref.wait_s
    while backend.inflight > 0 and gw.clock() < end:
        await asyncio.sleep(0.05)
    return describe(pool, backend)


def restore(gw: Gateway, ref: BackendRef) -> dict[str, Any]:
    """Back in rotation once a health check passes; one not drained is left as it is."""
    pool, backend = find(gw, ref)
    if backend is None:
        # Dropped while drained (a pool with DNS backends sweeps idle retired ones): listed
        # statically in the config, it joins again.
        url = ref.url.rstrip("/")
        listed = next(
            (
                bs
                for bs in gw.settings.models[ref.model].backends
                if bs.discovery == "static" and bs.base == url
            ),
            None,
        )
        if listed is None:
            raise unknown(ref)
        backend = pool.add(listed, source=None)
        backend.healthy = False
        gw.watch(backend)  # its checks were stopped when it was dropped
        log.warning("backend %s restored by an admin request: in once a check passes", url)
        return describe(pool, backend)
    listed_only(backend)
    if backend.retired:
        # As a newly discovered backend: untrusted until its first check, which decides at once.
        backend.retired = False
        backend.healthy = False
        backend.checked = False
        backend.health_streak = 0
        log.warning("backend %s restored by an admin request: in once a check passes", backend.url)
    return describe(pool, backend)


def backends_state(gw: Gateway) -> dict[str, Any]:
    return {
        "models": {
            name: [describe(pool, b) for b in pool.backends] for name, pool in gw.pools.items()
        }
    }
