"""A backend's own account of its load, read from its Prometheus ``/metrics`` (or llama-server's
``/slots``) under the names its kind exports (``backend_kind.Traits``).

The exposition is parsed with ``prometheus_client``'s parsers (the text format, or OpenMetrics
when the answer says so), so timestamps, exemplars, escaped label values and ``# HELP`` lines are
read as any Prometheus server reads them; of the text format only the wanted samples' lines are
parsed. A count exported once per model or engine (vLLM labels its gauges ``model_name``,
SGLang by ``tp_rank``) is summed; the KV usage, a fraction, is the fullest one's. Text that does
not parse is no report: the load goes stale, and the router counts a stale report as busy.
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
    # Tokens processed (prompt and generated) since the backend started; None: not exported.
    processed: float | None = None


_SUMMED = ("waiting", "running", "processed")


def parse_metrics(text: str, traits: Traits, content_type: str = "") -> LoadReport | None:
    """The load in a ``/metrics`` answer, or None when it does not parse.

    Counts (waiting, running, tokens) are summed over their label sets and names; the KV usage,
    a fraction, is the fullest label set's under the first of its names exported (a server that
    exports the current name and a deprecated one says the same thing twice)."""
    wanted = {name: field for field in (*_SUMMED, "kv_usage") for name in getattr(traits, field)}
    if not wanted:
        return LoadReport()
    openmetrics = "openmetrics" in content_type
    if not openmetrics:
        # Only the lines of the wanted samples go to the parser: an engine exports hundreds
        # of series, and this runs on the gateway's event loop every round for each backend.
        text = "\n".join(line for line in text.splitlines() if _sample_name(line) in wanted)
    parse = openmetrics_families if openmetrics else text_string_to_metric_families
    sums: dict[str, float] = {}
    kv: dict[str, float] = {}
    try:
        for family in parse(text):
            for sample in family.samples:
                field = wanted.get(sample.name)
                if field is None or not math.isfinite(sample.value):
                    continue
                if field == "kv_usage":
                    kv[sample.name] = max(kv.get(sample.name, 0.0), sample.value)
                else:
                    sums[field] = sums.get(field, 0.0) + sample.value
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    kv_usage = next((kv[name] for name in traits.kv_usage if name in kv), 0.0)
    return LoadReport(
        waiting=sums.get("waiting", 0.0),
        running=sums.get("running", 0.0),
        kv_usage=kv_usage,
        processed=sums.get("processed"),
    )


def _sample_name(line: str) -> str:
    end = len(line)
    for stop in ("{", " "):
        at = line.find(stop)
        if 0 <= at < end:
            end = at
    return line[:end]


def parse_slots(body: Any) -> LoadReport | None:
    """llama-server's ``/slots``: one object per slot, ``is_processing`` while it serves one.
    Requests deferred (every slot busy) are not listed there: waiting stays unknown (0)."""
    if not isinstance(body, list):
        return None
    running = sum(1 for slot in body if isinstance(slot, dict) and slot.get("is_processing"))
    return LoadReport(running=float(running))
