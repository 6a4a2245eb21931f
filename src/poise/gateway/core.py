"""What the gateway's parts read of one another: the shared state, as a protocol.

``app.Gateway`` assembles pools, gates, limits and the retry budget and hands itself to the
parts built on them (autoscaling, metrics, ``/debug/state``, ``/admin``, the proxy). Those
parts name only this protocol (and their own additions to it), never ``app``, so the gateway's
modules form layers: a part may import what lies below it, and ``app`` alone sees them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from poise.gateway.admission import PoolGate
from poise.gateway.config import GatewaySettings
from poise.gateway.limits import GatewayLimits
from poise.gateway.pool import Pool
from poise.gateway.success_estimate import SuccessTallies
from poise.resilience.retry import RetryBudget


class GatewayCore(Protocol):
    settings: GatewaySettings
    clock: Callable[[], float]
    pools: dict[str, Pool]  # per model
    gates: dict[str, PoolGate]  # the admission queue of each pool
    limits: GatewayLimits
    budget: RetryBudget
    success: SuccessTallies  # formula 2's counts
