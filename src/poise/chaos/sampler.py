"""What the deployment says about itself during a run, sampled a few times a second.

The gateway's ``/debug/state`` (which backends it would route to, breakers, Redis) and each
replica's (KV blocks in use, preemptions, requests in flight), plus the gateway's count of
streams migrated mid-way from ``/metrics``. A target that does not answer (killed, stopped,
not a poise server, a state without the fields read here) is sampled as down, with None for
what it holds: the timeline shows it so, and the leak check after the run fails on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from poise.bench.client import auth_headers
from poise.bench.gateway_counts import success_counts
from poise.resilience.success import SuccessPolicy, Tally

MIGRATIONS = "poise_gateway_stream_migrations"


@dataclass(slots=True)
class ReplicaSample:
    up: bool  # answered /debug/state as a poise replica; if not, every count below is None
    kv_used_blocks: int | None = None
    kv_capacity_blocks: int | None = None  # the pool, or what a fault limits it to
    # Requests held back for lack of KV room since the replica started (None: not reported).
    room_waits: int | None = None
    preemptions: int | None = None
    inflight: int | None = None


@dataclass(slots=True)
class Sample:
    t: float  # seconds from the run's start
    gateway_up: bool
    eligible: list[str] | None = None  # backend URLs the gateway would route to
    breakers: dict[str, str] = field(default_factory=dict)
    redis_up: bool | None = None
    gateway_inflight: int | None = None  # admitted and queued requests
    replicas: list[ReplicaSample] = field(default_factory=list)
    # The gateway's formula 2 counts since it started, and its policy (None: it gave none).
    tally: Tally | None = None
    policy: SuccessPolicy | None = None


async def _json(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> dict[str, Any] | None:
    try:
        async with session.get(url, headers=headers) as r:
            return await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def replica_sample(state: dict[str, Any] | None) -> ReplicaSample:
    if not isinstance(state, dict) or state.get("role") != "replica":
        return ReplicaSample(False)
    try:
        kv = state["kv_cache"]
        return ReplicaSample(
            True,
            kv_used_blocks=int(kv["total_blocks"]) - int(kv["free_blocks"]),
            kv_capacity_blocks=int(kv["total_blocks"]),
            room_waits=_count(state["engine"].get("room_waits_total")),
            preemptions=int(state["engine"]["preemptions_total"]),
            inflight=int(state["inflight_requests"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return ReplicaSample(False)  # not the state this reads: unreadable, not empty


def _count(value: object) -> int | None:
    """An optional reading (the leak check needs only what is held): a count, or None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def gateway_sample(t: float, state: dict[str, Any] | None) -> Sample:
    if state is None or state.get("role") != "gateway":
        return Sample(t, False)
    eligible: list[str] = []
    breakers: dict[str, str] = {}
    inflight = 0
    for model in state["models"].values():
        # Trusted by every check: in panic the gateway routes to backends it knows are down.
        eligible += model.get("trusted", model["eligible"])
        inflight += model["queue"]["waiting"] + model["queue"]["admitted"]
        for b in model["backends"]:
            breakers[b["url"]] = b["breaker"]
    s = Sample(t, True, eligible, breakers, state["rate_limits"]["redis_up"], inflight)
    s.tally, s.policy = success_counts(state)
    return s


class Sampler:
    def __init__(
        self,
        gateway_url: str,
        replica_urls: list[str],
        t0: float,
        period_s: float = 0.25,
        api_key: str | None = None,
    ) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        # A gateway with keys protects /debug/state as it protects the API.
        self.headers = auth_headers(api_key)
        self.replica_urls = [u.rstrip("/") for u in replica_urls]
        self.t0 = t0
        self.period_s = period_s
        self.samples: list[Sample] = []
        self.migrations = 0.0  # increase of the gateway's counter, across its restarts
        self._last_migrations: float | None = None

    async def sample(self, session: aiohttp.ClientSession) -> Sample:
        t = time.perf_counter() - self.t0
        states = await asyncio.gather(
            _json(session, self.gateway_url + "/debug/state", self.headers),
            *(_json(session, u + "/debug/state") for u in self.replica_urls),
        )
        s = gateway_sample(t, states[0])
        s.replicas = [replica_sample(r) for r in states[1:]]
        self.samples.append(s)
        return s

    async def count_migrations(self, session: aiohttp.ClientSession) -> None:
        try:
            async with session.get(self.gateway_url + "/metrics", headers=self.headers) as r:
                text = await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError):
            return
        value = sum(
            s.value
            for family in text_string_to_metric_families(text)
            if family.name == MIGRATIONS
            for s in family.samples
            if s.name == MIGRATIONS + "_total" and s.labels.get("result") == "resumed"
        )
        if self._last_migrations is not None:
            # A counter that went down was restarted: it counts from zero again.
            self.migrations += (
                value - self._last_migrations if value >= self._last_migrations else value
            )
        self._last_migrations = value

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=min(1.0, 2 * self.period_s))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tick = 0
            while not stop.is_set():
                await self.sample(session)
                if tick % 4 == 0:
                    await self.count_migrations(session)
                tick += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.period_s)
            await self.count_migrations(session)
