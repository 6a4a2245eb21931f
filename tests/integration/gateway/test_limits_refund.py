"""Token refunds go back to the store that charged them, across a Redis outage (real Redis)."""

from __future__ import annotations

import asyncio

from poise.gateway.config import RateLimitSettings
from poise.gateway.limits import GatewayLimits
from poise.resilience.ratelimit import Charge, Limit
from redisproc import RedisServer

TPM = Limit(per_minute=1000)


def tokens(cost: float) -> list[Charge]:
    return [Charge("key:a:tokens", TPM, cost, "tokens")]


async def remaining(limits: GatewayLimits, shared: bool) -> float:
    """The bucket's level in one store, read by a charge of nothing."""
    if shared:
        assert limits.shared is not None
        decision = await limits.shared.check(tokens(0))
    else:
        decision = limits.local.check(tokens(0))
    return decision.states[0].remaining


async def test_a_charge_taken_while_redis_was_down_is_refunded_here_not_in_redis(tmp_path):
    with RedisServer(tmp_path) as redis_server:
        limits = GatewayLimits(RateLimitSettings(redis_url=redis_server.url, redis_retry_s=0.01))
        try:
            redis_server.kill()
            checked = await limits.check(tokens(600))  # Redis is down: charged in this gateway
            assert checked.decision.allowed and not checked.shared
            redis_server.start()  # back, empty; other gateways draw on it
            # Until this gateway is back on it (a charge of nothing): its first answers, the
            # script loaded afresh, can take longer than the 0.25 s timeout on a busy host.
            for _ in range(100):
                if (await limits.check(tokens(0))).shared:
                    break
                await asyncio.sleep(0.05)
            other = await limits.check(tokens(500))
            assert other.shared and limits.redis_up
            shared_before = await remaining(limits, shared=True)
            local_before = await remaining(limits, shared=False)
            # The request used 100 of the 600 estimated: 500 go back where they were taken.
            await limits.adjust(tokens(-500)[0], checked.shared)
            # (Both buckets refill at 1000 a minute meanwhile: a few tokens, never 500.)
            assert await remaining(limits, shared=True) < shared_before + 50  # no gift to Redis
            assert await remaining(limits, shared=False) >= local_before + 499
        finally:
            await limits.aclose()
