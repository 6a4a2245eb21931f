"""Backends behind a DNS name: one per address, kept in step as the name's answer changes.

A backend listed with ``discovery: dns`` stands for every address its host resolves to (as
Envoy's STRICT_DNS clusters; a Kubernetes headless Service answers with one address per ready
pod). Every ``dns_refresh_s`` the name is resolved again:
- an address that appears becomes a backend that enters routing through its health checks;
- an address that disappears is retired: no new attempts go to it, what it holds finishes,
  and it is dropped once idle;
- a failed resolution changes nothing (logged): DNS trouble never empties a pool.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

from poise.gateway.config import BackendSettings
from poise.gateway.pool import Backend, Pool

log = logging.getLogger("poise.gateway.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` has, through the system's resolver (sorted, no duplicates)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def address_url(template: str, address: str) -> str:
    """``template`` with its host replaced by ``address`` (bracketed when IPv6)."""
    parts = urlsplit(template)
    host = f"[{address}]" if ":" in address else address
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)).rstrip("/")


class DnsBackends:
    """One ``discovery: dns`` entry of one pool."""

    def __init__(
        self,
        pool: Pool,
        template: BackendSettings,
        on_added: Callable[[Backend], None],
        on_removed: Callable[[Backend], None],
        resolver: Resolver = resolve,
    ) -> None:
        self.pool = pool
        self.template = template
        self.on_added = on_added
        self.on_removed = on_removed
        self.resolver = resolver
        parts = urlsplit(template.base)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.failures = 0

    def mine(self) -> dict[str, Backend]:
        return {
            b.url: b for b in self.pool.backends if b.source == self.template.base and not b.retired
        }

    async def refresh(self) -> None:
        try:
            addresses = await self.resolver(self.host, self.port)
        except OSError as exc:
            self.failures += 1
            log.warning("resolving %s failed (%s); keeping its %d backends", self.host, exc,
                        len(self.mine()))  # fmt: skip
            addresses = None
        if addresses is not None:
            wanted = {address_url(self.template.base, a) for a in addresses}
            current = self.mine()
            for url in sorted(wanted - current.keys()):
                settings = self.template.model_copy(update={"url": url, "discovery": "static"})
                backend = self.pool.add(settings, source=self.template.base)
                log.info("%s: backend %s discovered", self.host, url)
                self.on_added(backend)
            for url in sorted(current.keys() - wanted):
                self.pool.retire(current[url])
                log.info("%s: backend %s no longer listed; draining it", self.host, url)
        for backend in self.pool.sweep():
            self.on_removed(backend)

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.template.dns_refresh_s)
