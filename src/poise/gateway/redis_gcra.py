"""The same GCRA as ``ratelimit``, run inside Redis so that several gateways share one budget.

One Lua script checks every limit of a request and takes from all or none, atomically on the
server, with the server's own clock (``TIME``), so gateways with skewed clocks still agree.
A bucket is one string key holding its TAT, expiring once the bucket would be full again.
Scripts return numbers as strings: Redis truncates Lua numbers to integers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from redis.asyncio import Redis

from poise.resilience.ratelimit import Charge, LimitState, RateDecision

_CHECK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = #KEYS
local tats, out = {}, {}
local allowed, retry, refused = 1, 0, 0
for i = 1, n do
  local interval = tonumber(ARGV[3 * i - 2])
  local window = tonumber(ARGV[3 * i - 1]) * interval
  local cost = tonumber(ARGV[3 * i])
  local tat = tonumber(redis.call('GET', KEYS[i])) or now
  local base = math.max(tat, now)
  local new_tat = base + cost * interval
  local after = new_tat
  if new_tat - now > window + 1e-9 then
    after = base
    if allowed == 1 then refused = i end
    allowed = 0
    local wait = new_tat - now - window
    if cost * interval > window then wait = -1 end
    if wait < 0 or (retry >= 0 and wait > retry) then retry = wait end
  end
  tats[i] = new_tat
  out[#out + 1] = tostring(math.max(0, (window - (after - now)) / interval))
  out[#out + 1] = tostring(math.max(0, after - now))
end
if allowed == 1 then
  for i = 1, n do
    local ttl = math.ceil((tats[i] - now) * 1000) + 1000
    redis.call('SET', KEYS[i], tostring(tats[i]), 'PX', ttl)
  end
end
return {allowed, tostring(retry), refused, unpack(out)}
"""

_ADJUST = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local interval = tonumber(ARGV[1])
local tat = math.max(now, tonumber(redis.call('GET', KEYS[1])) or now)
local new_tat = math.max(now, tat + tonumber(ARGV[2]) * interval)
if new_tat > now then
  redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil((new_tat - now) * 1000) + 1000)
else
  redis.call('DEL', KEYS[1])
end
return 1
"""


class RedisRateLimiter:
    """Shared limits. Raises ``redis.RedisError`` (or ``OSError``) when Redis cannot answer;
    the caller decides what to do then (the gateway falls back to local limits)."""

    def __init__(self, client: Redis, prefix: str = "poise:rl:") -> None:
        self.client = client
        self.prefix = prefix
        self._check = client.register_script(_CHECK)
        self._adjust = client.register_script(_ADJUST)

    async def check(self, charges: Sequence[Charge]) -> RateDecision:
        keys = [self.prefix + c.key for c in charges]
        args: list[float] = []
        for c in charges:
            args += [c.limit.interval_s, c.limit.capacity, c.cost]
        reply = await self._check(keys=keys, args=args)
        allowed, retry, refused = int(reply[0]), float(reply[1]), int(reply[2])
        states = tuple(
            LimitState(
                kind=c.kind,
                limit=c.limit.capacity,
                remaining=float(reply[3 + 2 * i]),
                reset_s=float(reply[4 + 2 * i]),
            )
            for i, c in enumerate(charges)
        )
        if allowed:
            return RateDecision(True, 0.0, None, states)
        return RateDecision(
            False, math.inf if retry < 0 else retry, charges[refused - 1].key, states
        )

    async def adjust(self, charge: Charge) -> None:
        await self._adjust(
            keys=[self.prefix + charge.key], args=[charge.limit.interval_s, charge.cost]
        )
