"""The autoscaling decision (formula 5) for each model, computed live where the load is seen.

Every ``interval_s`` the gateway feeds each model's ``Autoscaler`` what it counts itself
(requests arrived, requests completed) and what is waiting (its own admission queue plus the
waiting requests its backends report), with the number of backends it routes to. The decision
is exported as metrics (``poise_gateway_desired_replicas``, ...) for KEDA or an HPA, and as JSON
on ``/autoscale`` for ``poise up --autoscale`` and for people. The gateway only advises: what
scales is whatever reads it.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from poise.gateway.core import GatewayCore
from poise.resilience.autoscale import AutoscaleConfig, Autoscaler, Decision


class ModelScaling:
    def __init__(self, model: str, config: AutoscaleConfig, gw: GatewayCore) -> None:
        self.model = model
        self.gw = gw
        self.scaler = Autoscaler(config, gw.clock)
        self.arrived = 0
        self.completed = 0
        self.decision: Decision | None = None

    def waiting(self) -> float:
        pool = self.gw.pools[self.model]
        reported = sum(b.load.waiting for b in pool.backends if pool.trusted(b))
        return len(self.gw.gates[self.model].line) + reported

    def tick(self) -> Decision:
        # Serving: trusted by every check, not merely routed to in panic.
        pool = self.gw.pools[self.model]
        serving = sum(pool.trusted(b) for b in pool.backends)
        self.scaler.observe(self.arrived, self.completed, self.waiting(), serving)
        self.decision = self.scaler.decide()
        return self.decision

    def state(self) -> dict[str, Any]:
        d = self.decision
        return {
            "decision": None if d is None else asdict(d),
            "config": asdict(self.scaler.config),
            "arrived_total": self.arrived,
            "completed_total": self.completed,
        }


class Autoscaling:
    def __init__(self, gw: GatewayCore, config: AutoscaleConfig, interval_s: float) -> None:
        self.interval_s = interval_s
        self.models = {m: ModelScaling(m, config, gw) for m in gw.settings.models}

    def arrived(self, model: str) -> None:
        self.models[model].arrived += 1

    def completed(self, model: str) -> None:
        scaling = self.models.get(model)
        if scaling is not None:
            scaling.completed += 1

    async def run(self) -> None:
        while True:
            for scaling in self.models.values():
                scaling.tick()
            await asyncio.sleep(self.interval_s)

    def state(self) -> dict[str, Any]:
        return {"models": {m: s.state() for m, s in self.models.items()}}
