"""A backend's own account of its load, read from its Prometheus ``/metrics`` (or llama-server's
``/slots``) under the names its kind exports (``backend_kind.Traits``).

The exposition is parsed with ``prometheus_client``'s parsers (the text format, or OpenMetrics
when the answer says so), so timestamps, exemplars, escaped label values and ``# HELP`` lines are
read as any Prometheus server reads them. A gauge exported once per model or engine (vLLM labels
its gauges ``model_name``, SGLang by ``tp_rank``) is summed. Text that does not parse is no
report: the load goes stale, and the router counts a backend whose report is stale as busy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from poise.gateway.backend_kind import Traits


@dataclass(frozen=True, slots=True)
class LoadReport:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    generated: float | None = None  # tokens generated since the backend started; None: unknown


def parse_metrics(text: str, traits: Traits, content_type: str = "") -> LoadReport | None:
    """The load in a ``/metrics`` answer, or None when it does not parse."""
    parse = (
        openmetrics_families if "openmetrics" in content_type else text_string_to_metric_families
    )
    wanted = {
        name: field
        for field in ("waiting", "running", "kv_usage", "generated")
        for name in getattr(traits, field)
    }
    sums: dict[str, float] = {}
    try:
        for family in parse(text):
            for sample in family.samples:
                field = wanted.get(sample.name)
                if field is not None and math.isfinite(sample.value):
                    sums[field] = sums.get(field, 0.0) + sample.value
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    return LoadReport(
        waiting=sums.get("waiting", 0.0),
        running=sums.get("running", 0.0),
        kv_usage=sums.get("kv_usage", 0.0),
        generated=sums.get("generated"),
    )


def parse_slots(body: Any) -> LoadReport | None:
    """llama-server's ``/slots``: one object per slot, ``is_processing`` while it serves one.
    Requests deferred (every slot busy) are not listed there: waiting stays unknown (0)."""
    if not isinstance(body, list):
        return None
    running = sum(1 for slot in body if isinstance(slot, dict) and slot.get("is_processing"))
    return LoadReport(running=float(running))
