"""``/debug/state``: the gateway's live state as JSON, for an operator asking "why?".

Breakers, health, ejections, load reports, queues and the retry budget, as the gateway sees
them at this instant. It is protected like the API (a configured key is required when keys are
configured) because it names every backend.
"""

from __future__ import annotations

from typing import Any

from poise.gateway.core import GatewayCore


def gateway_state(gw: GatewayCore) -> dict[str, Any]:
    now = gw.clock()
    models: dict[str, Any] = {}
    for name, pool in gw.pools.items():
        gate = gw.gates[name]
        backends = []
        for b in pool.backends:
            load = b.load
            backends.append(
                {
                    "url": b.url,
                    "kind": b.kind,  # its engine; None until detected
                    "weight": b.settings.weight,
                    "healthy": b.healthy,
                    "checked": b.checked,
                    "draining": b.retired,  # out of routing: drained or no longer discovered
                    "breaker": b.breaker.state.value,
                    "ejected": pool.outliers.is_ejected(b.url),
                    "error_answers": b.error_answers,  # its latest attempts answered 5xx, in a row
                    "slow": pool.slow_ejected(b),  # out for its time per token
                    "latency_cost": round(pool.latency.cost(b.url), 3),
                    "inflight": b.inflight,
                    "reported_load": {
                        "waiting": load.waiting,
                        "running": load.running,
                        "kv_usage": load.kv_usage,
                        "processed_tokens": load.processed,
                        "age_s": None if load.at is None else round(now - load.at, 3),
                    },
                }
            )
        models[name] = {
            "backends": backends,
            "eligible": [b.url for b in pool.eligible()],
            "trusted": [b.url for b in pool.backends if pool.trusted(b)],  # every check passes
            "panic": pool.in_panic,  # nothing passes every check: routing to all that may serve
            "ejections_total": pool.outliers.ejections_total,
            "queue": {"waiting": len(gate.line), "admitted": gate.admitted},
            "capacity": gate.capacity(),
            "saturated": gate.saturated,
            "fallback": list(gw.settings.models[name].fallback),
        }
    estimates = gw.success.estimates()  # formula 2 over the last minute
    for name, model in models.items():
        e = estimates.get(name)
        model["success_estimate"] = None if e is None else e.as_dict()
    budget = gw.budget
    return {
        "role": "gateway",
        "models": models,
        "retry_budget": {
            "active_retries": budget.active_retries,
            "limit": budget.limit,
            "peak": budget.peak_retries,
            "refused_total": budget.refused_total,
        },
        "rate_limits": {
            "shared": gw.limits.shared is not None,
            "redis_up": gw.limits.redis_up if gw.limits.shared is not None else None,
        },
        # Formula 2's counts since the gateway started: two readings' difference is a run's.
        "success_tally": gw.success.totals().as_dict(),
        "success_policy": gw.success.policy.as_dict(),
    }
