"""Which requests may be answered from the cache, and the cache's bounds."""

from __future__ import annotations

from poise.gateway.response_cache import ResponseCache, cache_key


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_only_deterministic_non_streaming_requests_have_a_key():
    greedy = {"model": "m", "prompt": "x", "temperature": 0}
    assert cache_key("/v1/completions", greedy) is not None
    assert cache_key("/v1/completions", {**greedy, "user": "a"}) == cache_key(
        "/v1/completions", {**greedy, "user": "b"}
    )
    assert cache_key("/v1/completions", {**greedy, "max_tokens": 5}) != cache_key(
        "/v1/completions", greedy
    )
    assert cache_key("/v1/chat/completions", greedy) != cache_key("/v1/completions", greedy)
    assert cache_key("/v1/completions", {"model": "m", "prompt": "x", "seed": 3}) is not None
    assert cache_key("/v1/completions", {"model": "m", "prompt": "x"}) is None  # sampled
    assert cache_key("/v1/completions", {**greedy, "stream": True}) is None


def test_bounded_by_entries_and_age():
    clock = Clock()
    cache = ResponseCache(max_entries=2, ttl_s=10, clock=clock)
    cache.put("a", b"A", {})
    cache.put("b", b"B", {})
    assert cache.get("a") == (b"A", {})  # a is now the most recently used
    cache.put("c", b"C", {})
    assert cache.get("b") is None and len(cache) == 2
    clock.now = 11
    assert cache.get("a") is None and cache.get("c") is None
