"""The gateway's rate limits: in-process, or shared through Redis with a local fallback.

With Redis every gateway draws on one budget per key and model. When Redis cannot answer within
its timeout the gateway does not stop serving: it enforces the same limits locally (each
gateway then allows the whole limit on its own), says so once in the log and in
``poise_gateway_ratelimit_redis_up``, and tries Redis again after ``retry_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from poise.gateway.config import RateLimitSettings
from poise.gateway.redis_gcra import RedisRateLimiter
from poise.resilience.ratelimit import Charge, RateDecision, RateLimiter

log = logging.getLogger("poise.gateway")


class GatewayLimits:
    def __init__(
        self,
        settings: RateLimitSettings,
        clock: Callable[[], float] = time.monotonic,
        on_fallback: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.local = RateLimiter(clock)
        self.on_fallback = on_fallback
        self.shared: RedisRateLimiter | None = None
        # Shared with the gateway's other Redis users (shared verdicts): one pool per gateway.
        self.client: Redis | None = None
        if settings.redis_url is not None:
            self.client = Redis.from_url(
                settings.redis_url,
                socket_timeout=settings.redis_timeout_s,
                socket_connect_timeout=settings.redis_timeout_s,
            )
            self.shared = RedisRateLimiter(self.client, settings.key_prefix)
        self._down_until = 0.0
        self.redis_up = self.shared is not None

    async def check(self, charges: Sequence[Charge]) -> RateDecision:
        if self.shared is not None and self.clock() >= self._down_until:
            try:
                decision = await self.shared.check(charges)
            except (RedisError, OSError) as exc:
                self._went_down(exc)
            else:
                if not self.redis_up:
                    log.warning("rate limits: Redis answers again; limits are shared again")
                    self.redis_up = True
                return decision
        return self.local.check(charges)

    async def adjust(self, charge: Charge) -> None:
        if self.shared is not None and self.redis_up:
            try:
                await self.shared.adjust(charge)
                return
            except (RedisError, OSError) as exc:
                self._went_down(exc)
        self.local.adjust(charge)

    def _went_down(self, exc: Exception) -> None:
        self._down_until = self.clock() + self.settings.redis_retry_s
        self.on_fallback()
        if self.redis_up:
            log.error(
                "rate limits: Redis unreachable (%s); enforcing limits locally in this gateway",
                exc,
            )
            self.redis_up = False

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
