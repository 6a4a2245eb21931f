"""Passive outlier ejection for a pool of backends, as Envoy's outlier detection.

``consecutive_failures`` failures in a row eject a backend for ``base_s × n`` (n = how many
times it has been ejected, capped at ``max_s``) plus up to ``jitter_s`` so that backends ejected
together do not return together. A backend that stays healthy for ``base_s`` after returning
earns one ejection back. Two guards keep ejection from emptying a pool: never more than
``max_ejected_share`` of the pool is out at once, and never the last backend that is not out.

Pure: the clock and the random source are injected.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EjectionConfig:
    consecutive_failures: int = 5
    base_s: float = 30.0
    max_s: float = 300.0
    max_ejected_share: float = 0.5
    jitter_s: float = 1.0

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError("consecutive_failures must be at least 1")
        if self.base_s <= 0 or self.max_s < self.base_s or self.jitter_s < 0:
            raise ValueError("ejection times must satisfy 0 < base_s <= max_s, jitter_s >= 0")
        if not 0 <= self.max_ejected_share <= 1:
            raise ValueError("max_ejected_share must be in [0, 1]")


@dataclass(slots=True)
class _Host:
    failures_in_row: int = 0
    times_ejected: int = 0
    ejected_until: float | None = None
    healthy_since: float = 0.0


class OutlierDetector:
    def __init__(
        self,
        backends: Iterable[str],
        config: EjectionConfig,
        clock: Callable[[], float],
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng or random.Random()
        self._hosts = {b: _Host() for b in backends}
        self.ejections_total = 0

    def add(self, backend: str) -> None:
        """A backend discovered later (DNS): it starts with a clean record."""
        self._hosts.setdefault(backend, _Host())

    def remove(self, backend: str) -> None:
        self._hosts.pop(backend, None)

    def is_ejected(self, backend: str) -> bool:
        host = self._hosts[backend]
        if host.ejected_until is None:
            return False
        if self.clock() >= host.ejected_until:
            host.ejected_until = None
            host.failures_in_row = 0
            host.healthy_since = self.clock()
            return False
        return True

    def ejected_for(self, backend: str) -> float | None:
        """Seconds this backend stays ejected; None when it is not."""
        if not self.is_ejected(backend):
            return None
        until = self._hosts[backend].ejected_until
        return None if until is None else until - self.clock()

    @property
    def ejected(self) -> list[str]:
        return [b for b in self._hosts if self.is_ejected(b)]

    def record(self, backend: str, ok: bool) -> bool:
        """One call's outcome. Returns True when this outcome ejected the backend."""
        host = self._hosts[backend]
        now = self.clock()
        if ok:
            host.failures_in_row = 0
            if host.times_ejected and now - host.healthy_since >= self.config.base_s:
                host.times_ejected -= 1
                host.healthy_since = now
            return False
        host.failures_in_row += 1
        if self.is_ejected(backend) or host.failures_in_row < self.config.consecutive_failures:
            return False
        if not self._may_eject():
            return False
        host.times_ejected += 1
        duration = min(self.config.base_s * host.times_ejected, self.config.max_s)
        host.ejected_until = now + duration + self.rng.uniform(0, self.config.jitter_s)
        self.ejections_total += 1
        return True

    def _may_eject(self) -> bool:
        out = len(self.ejected)
        total = len(self._hosts)
        if out + 1 >= total:  # never the last one standing
            return False
        return out + 1 <= self.config.max_ejected_share * total
