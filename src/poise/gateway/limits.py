"""The gateway's rate limits: in-process, or shared through Redis with a local fallback.

With Redis every gateway draws on one budget per key and model. When Redis cannot answer within
its timeout the gateway does not stop serving: it enforces the same limits locally (each
gateway then allows the whole limit on its own), says so once in the log and in
``poise_gateway_ratelimit_redis_up``, and tries Redis again after ``retry_s``. A request's
charges are corrected (refunds of unused tokens) in the store that took them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from poise.gateway.config import RateLimitSettings
from poise.gateway.redis_gcra import RedisRateLimiter
from poise.resilience.ratelimit import Charge, RateDecision, RateLimiter

log = logging.getLogger("poise.gateway")


@dataclass(frozen=True, slots=True)
class Checked:
    """A decision, and where its charges were taken: corrections go back to the same store."""

    decision: RateDecision
    shared: bool  # in Redis; else in this gateway's own limiter


class GatewayLimits:
    def __init__(
        self,
        settings: RateLimitSettings,
        clock: Callable[[], float] = time.monotonic,
        on_fallback: Callable[[], None] = lambda: None,
        on_checked: Callable[[bool], None] = lambda redis_answered: None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.local = RateLimiter(clock)
        self.on_fallback = on_fallback
        self.on_checked = on_checked  # each check while Redis is configured: did it answer
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

    async def check(self, charges: Sequence[Charge]) -> Checked:
        if self.shared is not None and self.clock() >= self._down_until:
            try:
                decision = await self.shared.check(charges)
            except (RedisError, OSError) as exc:
                self._went_down(exc)
            else:
                if not self.redis_up:
                    log.warning("rate limits: Redis answers again; limits are shared again")
                    self.redis_up = True
                self.on_checked(True)
                return Checked(decision, shared=True)
        if self.shared is not None:
            self.on_checked(False)
        return Checked(self.local.check(charges), shared=False)

    async def adjust(self, charge: Charge, shared: bool) -> None:
        """Correct a charge in the store that took it (``Checked.shared``), whichever answers
        now: a charge taken here while Redis was down is corrected here, and one taken in Redis
        is corrected there or not at all (a lost correction errs on the side of the charge)."""
        if not shared:
            self.local.adjust(charge)
            return
        if self.shared is None or self.clock() < self._down_until:
            return  # Redis is known to be down: not worth a timeout on the request's path
        try:
            await self.shared.adjust(charge)
        except (RedisError, OSError) as exc:
            self._went_down(exc)

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
