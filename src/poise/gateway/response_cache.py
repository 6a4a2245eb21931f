"""The last fallback: a stored answer to an identical deterministic request (opt-in per model).

Only requests whose answer cannot differ are stored and served: non-streaming, greedy
(``temperature`` 0) or seeded, and answered 200. The key is the model, the path and the body
in canonical form, less fields that do not change the answer (``user``). Bounded in entries
(least recently used leaves first) and in age. A cached answer is served only when every pool
of the fallback chain has failed, and always says so (``x-poise-fallback: cache``).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

_IGNORED = frozenset({"user"})


def cache_key(path: str, data: dict[str, Any]) -> str | None:
    """The key of a request whose answer is deterministic; None for any other."""
    if data.get("stream") is True:
        return None
    temperature = data.get("temperature")
    if temperature != 0 and data.get("seed") is None:
        return None
    canonical = json.dumps(
        {k: v for k, v in data.items() if k not in _IGNORED}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(f"{path}\n{canonical}".encode()).hexdigest()


class ResponseCache:
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, bytes, dict[str, str]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, body: bytes, headers: dict[str, str]) -> None:
        if self.max_entries <= 0:
            return
        self._entries[key] = (self.clock(), body, headers)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, key: str) -> tuple[bytes, dict[str, str]] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        stored, body, headers = entry
        if self.clock() - stored > self.ttl_s:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return body, headers
