"""The gateway's formula 2 counts: what each event adds, the sliding minute, the totals."""

import pytest

from poise.gateway.record import RequestRecord
from poise.gateway.success_estimate import REFRESH_S, SLOT_S, WINDOW_S, SuccessTallies
from poise.resilience.success import LATENCY_BOUNDS, SuccessPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(outcome: str, model: str | None = "m", e2e_s: float | None = 0.3) -> RequestRecord:
    r = RequestRecord("id", "/v1/completions", 0.0, model=model, outcome=outcome)
    r.e2e_s = e2e_s if outcome == "ok" else None
    return r


def test_each_outcome_lands_in_its_term_and_the_clients_own_count_neither_way():
    clock = Clock()
    t = SuccessTallies(SuccessPolicy(), clock)
    for outcome in ("ok", "ok", "timeout", "timeout", "no_backend", "upstream_error", "shed"):
        t.finished(record(outcome))
    t.refused("m", "shed")  # the shed one, as the admission queue reports it
    t.refused("m", "deadline")  # a timeout: its deadline passed in the queue
    for outcome in ("client_error", "client_gone", "rate_limited"):
        t.finished(record(outcome))
    t.finished(record("ok", model=None))  # no model read: no pool to count it for
    t.sent("m", routed=True)
    t.sent("m", routed=False)  # the no_backend one
    m = t.window().models["m"]
    assert (m.requests, m.refused, m.missed_deadline) == (7, 1, 2)
    assert (m.sent, m.unroutable) == (2, 1)
    assert m.latency[LATENCY_BOUNDS.index(0.5)] == 2  # 0.3 s: the (0.25, 0.5] bucket


def test_attempts_count_by_what_the_gateway_can_do_and_not_the_requests_deadline():
    t = SuccessTallies(SuccessPolicy(), Clock())
    for outcome, first, recovery in (
        ("ok", True, "retry"),
        ("error", True, "retry"),
        ("timeout", False, "retry"),
        ("connect_error", False, "none"),
        ("timeout", False, "move"),
        ("error", False, "resume"),
        ("overloaded", True, "move"),
        ("overloaded", False, "none"),  # a 429 to a call that may not be sent twice
        ("deadline", True, "retry"),
    ):
        t.attempted("m", "http://a", outcome, first, recovery)
    b = t.window().models["m"].backends["http://a"]
    assert (b.first, b.ok, b.failed, b.moved, b.overloaded, b.broken, b.final) == (
        3, 1, 2, 1, 1, 1, 2,
    )  # fmt: skip


def test_the_window_forgets_after_a_minute_and_the_totals_do_not():
    clock = Clock()
    t = SuccessTallies(SuccessPolicy(), clock)
    t.finished(record("upstream_error"))
    t.sent("m", routed=True)
    t.attempted("m", "http://a", "error", True, "retry")
    t.limits_checked(redis_answered=False)
    clock.now += 30
    for _ in range(3):
        t.finished(record("ok"))
        t.sent("m", routed=True)
        t.attempted("m", "http://a", "ok", True, "retry")
    t.limits_checked(redis_answered=True)
    # One backend, failing 1 attempt of 4: a failure is retried on it twice (there is no other).
    assert t.estimates()["m"].probability == pytest.approx(1 - 0.25**3)
    window = t.window()
    assert (window.redis_checks, window.redis_failed) == (2, 1)
    assert window.seconds == pytest.approx(30)
    clock.now += WINDOW_S + SLOT_S - 30  # the first slot is out of the window
    assert t.window().models["m"].requests == 3
    assert t.estimates()["m"].probability == 1.0
    clock.now += WINDOW_S + SLOT_S
    assert t.estimates() == {}  # nothing in the last minute: no estimate
    t.finished(record("timeout"))
    assert t.estimates() == {}  # computed at most once each REFRESH_S
    clock.now += REFRESH_S
    assert t.estimates()["m"].probability == 0.0
    totals = t.totals()
    assert totals.models["m"].requests == 5 and totals.redis_checks == 2
    assert totals.seconds == pytest.approx(clock.now - 1000.0) and totals.boot


def test_a_cache_turn_counts_whether_it_answered():
    t = SuccessTallies(SuccessPolicy(), Clock())
    t.cache_tried("m", answered=True)
    t.cache_tried("m", answered=False)
    m = t.window().models["m"]
    assert (m.cache_tried, m.cache_answered) == (2, 1)
