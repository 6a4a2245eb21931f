"""Breaker and ejection verdicts shared by every gateway through Redis.

Each gateway, once per health-check interval, writes the backends it has taken out of rotation
(outlier ejection, or an open breaker) into one Redis hash per model, as the wall-clock time
until which they are out, and reads what the other gateways wrote. A backend another gateway
took out is then avoided here too until that time, though this gateway has sent it nothing: a
replica ejected by one gateway is avoided by all within one interval. Verdicts expire by their
own time; nothing needs deleting when a gateway dies.

Redis trouble never stops serving: a failed round is logged (once per outage) and counted, and
each gateway goes on with its own verdicts. As with local ejection, a remote verdict that would
leave a model with no backend at all is not applied.

Written here because no library shares circuit-breaker state across processes; the hash and
its expiry are plain Redis commands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from redis.exceptions import RedisError

from poise.resilience.breaker import BreakerState

if TYPE_CHECKING:
    from poise.gateway.pool import Backend, Pool

log = logging.getLogger("poise.gateway.shared")

KEY_TTL_S = 600  # a hash nobody writes any more goes away


class SharedVerdicts:
    def __init__(
        self,
        redis: Redis,
        pools: dict[str, Pool],
        interval_s: float,
        clock: Callable[[], float],
        prefix: str = "poise:verdicts:",
        wall: Callable[[], float] = time.time,
        on_error: Callable[[], None] = lambda: None,
        on_applied: Callable[[], None] = lambda: None,
    ) -> None:
        self.redis = redis
        self.pools = pools
        self.interval_s = interval_s
        self.clock = clock
        self.wall = wall
        self.prefix = prefix
        self.on_error = on_error
        self.on_applied = on_applied
        self.up = True
        self.applied_total = 0  # remote verdicts taken on

    def _local_until(self, pool: Pool, b: Backend) -> float | None:
        """How long this gateway keeps ``b`` out, in seconds from now; None: it does not."""
        left = [pool.outliers.ejected_for(b.url)]
        if b.breaker.state is BreakerState.OPEN:
            left.append(b.breaker.open_for())
        out = [x for x in left if x is not None and x > 0]
        return max(out) if out else None

    async def sync_once(self) -> None:
        now, wall = self.clock(), self.wall()
        for model, pool in self.pools.items():
            key = self.prefix + model
            mine = {}
            for b in pool.backends:
                left = self._local_until(pool, b)
                if left is not None:
                    mine[b.url] = f"{wall + left:.3f}"
            async with self.redis.pipeline(transaction=False) as pipe:
                if mine:
                    pipe.hset(key, mapping=mine)
                    pipe.expire(key, KEY_TTL_S)
                pipe.hgetall(key)
                *_, shared = await pipe.execute()
            for raw_url, raw_until in shared.items():
                url = raw_url.decode() if isinstance(raw_url, bytes) else str(raw_url)
                if url in mine:
                    continue  # this gateway's own verdict
                try:
                    until = float(raw_until)
                except (TypeError, ValueError):
                    continue
                if until > wall and pool.remote_out(url, now + (until - wall)):
                    self.applied_total += 1
                    self.on_applied()
                    log.info("backend %s is out of rotation on another gateway's verdict", url)

    async def run(self) -> None:
        while True:
            try:
                await self.sync_once()
                if not self.up:
                    log.warning("shared verdicts: Redis answers again")
                self.up = True
            except (TimeoutError, RedisError, OSError) as exc:
                self.on_error()
                if self.up:
                    log.warning("shared verdicts: Redis failed (%s); local verdicts only", exc)
                self.up = False
            await asyncio.sleep(self.interval_s)
