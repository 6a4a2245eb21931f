"""A bounded waiting line ordered by priority, then arrival, with a time-to-live.

The gateway's admission queue in front of a saturated pool (and anyone else's). Lower priority
values go first, as in vLLM. When the line is full, a newcomer that outranks the worst entry
takes its place and the worst is shed (its owner is told at once, 429); a newcomer that does
not outrank anyone is refused (503: the queue itself is full). Entries older than the TTL
expire. Pure: no I/O, no sleeping, the clock is injected.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class QueueConfig:
    max_size: int = 256
    ttl_s: float = 10.0


@dataclass(slots=True)
class Offer:
    queued: bool
    shed: list[Hashable] = field(default_factory=list)  # entries pushed out to make room


class PriorityLine:
    def __init__(self, config: QueueConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self._order = itertools.count()
        # (priority, arrival sequence, enqueue time, id), sorted: best first.
        self._entries: list[tuple[int, int, float, Hashable]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ident: Hashable) -> bool:
        return any(e[3] == ident for e in self._entries)

    def offer(self, ident: Hashable, priority: int) -> Offer:
        entry = (priority, next(self._order), self.clock(), ident)
        shed: list[Hashable] = []
        if len(self._entries) >= self.config.max_size:
            if not self._entries or self._entries[-1][0] <= priority:
                return Offer(queued=False)
            worst = self._entries[-1]
            self._entries.pop()
            shed.append(worst[3])
        bisect.insort(self._entries, entry, key=lambda e: (e[0], e[1]))
        return Offer(queued=True, shed=shed)

    def best_priority(self) -> int | None:
        """The priority of the entry that would leave first; None when empty."""
        return self._entries[0][0] if self._entries else None

    def pop(self) -> Hashable | None:
        """The best entry, which leaves the line; None when empty."""
        return self._entries.pop(0)[3] if self._entries else None

    def remove(self, ident: Hashable) -> bool:
        for i, e in enumerate(self._entries):
            if e[3] == ident:
                del self._entries[i]
                return True
        return False

    def expire(self) -> list[Hashable]:
        """Entries that waited longer than the TTL; they leave the line."""
        limit = self.clock() - self.config.ttl_s
        gone = [e[3] for e in self._entries if e[2] <= limit]
        if gone:
            self._entries = [e for e in self._entries if e[2] > limit]
        return gone

    def oldest_wait_s(self) -> float:
        if not self._entries:
            return 0.0
        return self.clock() - min(e[2] for e in self._entries)
