"""What a poise gateway counted for formula 2 (``poise.resilience.success``), read from its
``/debug/state`` before and after a run: the run's predicted success is the estimate over the
difference, printed beside the share of the run's requests that succeeded.

Any other endpoint (another gateway, an engine) has no such state: the prediction is then "-".
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from poise.resilience.success import SuccessPolicy, Tally

SETTLE_S = 5.0  # the longest wait for the gateway to close the run's last requests


def success_counts(state: Any) -> tuple[Tally | None, SuccessPolicy | None]:
    """A poise gateway's formula 2 counts since it started, and its policy; (None, None) for
    another server's state."""
    try:
        return Tally.from_dict(state["success_tally"]), SuccessPolicy.from_dict(
            state["success_policy"]
        )
    except (KeyError, TypeError, ValueError):
        return None, None


def read_counts(
    url: str, headers: dict[str, str], settle: bool = False
) -> tuple[Tally | None, SuccessPolicy | None]:
    """The gateway's counts now; ``settle``: once it holds no request any more (a stream's
    record closes just after its last byte), or after ``SETTLE_S``."""
    end = time.monotonic() + (SETTLE_S if settle else 0.0)
    while True:
        try:
            state = httpx.get(url.rstrip("/") + "/debug/state", headers=headers, timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return None, None
        held = _held(state)
        if held == 0 or held is None or time.monotonic() >= end:
            return success_counts(state)
        time.sleep(0.1)


def _held(state: Any) -> int | None:
    try:
        return sum(m["queue"]["waiting"] + m["queue"]["admitted"] for m in state["models"].values())
    except (KeyError, TypeError, AttributeError):
        return None
