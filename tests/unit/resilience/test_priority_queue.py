"""The admission line: best first, shed the worst when full, refuse when nobody can be shed,
expire at the TTL; property: it never holds more than its bound and always pops the best."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from poise.resilience.priority_queue import PriorityLine, QueueConfig


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pops_by_priority_then_arrival():
    line = PriorityLine(QueueConfig(max_size=10), Clock())
    for ident, prio in [("a", 5), ("b", 0), ("c", 5), ("d", 1)]:
        assert line.offer(ident, prio).queued
    assert [line.pop() for _ in range(5)] == ["b", "d", "a", "c", None]


def test_full_line_sheds_the_worst_for_a_better_newcomer_and_refuses_otherwise():
    line = PriorityLine(QueueConfig(max_size=2), Clock())
    line.offer("low-1", 10)
    line.offer("low-2", 10)
    offer = line.offer("high", 0)
    assert offer.queued and offer.shed == ["low-2"]  # the latest of the worst goes first
    refused = line.offer("low-3", 10)
    assert not refused.queued and refused.shed == []
    assert [line.pop(), line.pop()] == ["high", "low-1"]


def test_entries_expire_at_the_ttl():
    clock = Clock()
    line = PriorityLine(QueueConfig(max_size=10, ttl_s=5.0), clock)
    line.offer("old", 0)
    clock.now = 3.0
    line.offer("new", 0)
    clock.now = 5.5
    assert line.expire() == ["old"]
    assert "new" in line and "old" not in line and line.oldest_wait_s() == 2.5


def test_remove():
    line = PriorityLine(QueueConfig(), Clock())
    line.offer(1, 0)
    assert line.remove(1) and not line.remove(1) and len(line) == 0


@given(
    st.integers(min_value=0, max_value=8),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=40),
)
def test_bound_and_order_hold(max_size, priorities):
    line = PriorityLine(QueueConfig(max_size=max_size), Clock())
    held: dict[int, int] = {}
    for ident, prio in enumerate(priorities):
        offer = line.offer(ident, prio)
        for victim in offer.shed:
            assert held.pop(victim) > prio  # only a strictly worse entry is ever shed
        if offer.queued:
            held[ident] = prio
        else:  # refused only when full of entries at least as good
            assert len(held) == max_size and all(p <= prio for p in held.values())
        assert len(line) == len(held) <= max_size
    popped = [line.pop() for _ in range(len(held))]
    assert popped == sorted(held, key=lambda i: (held[i], i))
