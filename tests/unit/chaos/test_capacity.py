"""Chaos's capacity: token events in the window over the events of an answer of the asked
length, the window put off until every client streams, and the steady rate made of it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from poise.bench.report import Record
from poise.chaos import command
from poise.chaos.capacity import CapacityError, Sent, capacity_of, event_times
from poise.launcher import stop_group


def answer(sent_at: float, ttft: float, gap: float, events: int, whole: bool = True) -> Record:
    record = Record(sent_at=sent_at, status=200, ttft_s=ttft, itl_s=[gap] * (events - 1))
    if whole:
        record.e2e_s = ttft + gap * (events - 1)
    else:
        record.abandoned, record.error = True, "abandoned by the client"
    return record


def loop(clients: int, first_ttft: float = 0.1) -> list[Sent]:
    """Each client: answers of 10 tokens 0.1 s apart back to back from t=0 for 6 s, the last
    cut at 6 s (walked away from: what it streamed counts)."""
    out = []
    for _ in range(clients):
        t, first = 0.0, True
        for _ in range(5):
            ttft = first_ttft if first else 0.1
            out.append(Sent(answer(t, ttft, 0.1, 10), 10, first))
            t += ttft + 0.9
            first = False
        out.append(Sent(answer(t, 0.1, 0.1, 9, whole=False), 10))
    return out


def test_event_times_are_on_the_runs_clock():
    assert event_times(answer(2.0, 0.5, 0.25, 3)) == [2.5, 2.75, 3.0]
    assert event_times(Record(sent_at=1.0, status=429)) == []


def test_the_window_counts_events_not_answers():
    found = capacity_of(loop(2), 1.0, 6.0, min_window_s=2.0)
    # 10 events a second per client; 10 events an answer: one answer a second per client.
    assert found.events_per_answer == 10
    assert found.rps == pytest.approx(2.0, rel=0.05)
    assert found.answers == 10 and found.refused == 0 and found.window_s == 5.0


def test_the_window_waits_for_every_clients_first_token():
    """A first wave whose prefills took 2.5 s: the window starts after them, not at 1 s."""
    found = capacity_of(loop(2, first_ttft=2.5), 1.0, 8.0, min_window_s=2.0)
    assert found.window_s == pytest.approx(8.0 - 2.5)
    with pytest.raises(CapacityError, match="too late"):
        capacity_of(loop(2, first_ttft=2.5), 1.0, 6.0, min_window_s=4.0)


def test_an_answer_is_the_asked_length_not_the_mean_of_those_that_completed():
    """Of lengths 10 and 40, the short ones complete within the window: an answer is 25."""
    sent = [Sent(answer(0.0, 0.1, 0.1, 10), 10, True), Sent(answer(0.0, 0.1, 0.1, 20, False), 40)]
    assert capacity_of(sent, 0.0, 3.0, min_window_s=1.0).events_per_answer == 25


def test_refusals_are_counted_and_no_answer_is_no_capacity():
    refused = [Sent(Record(sent_at=0.1 * i, status=429), 4) for i in range(3)]
    whole = Sent(answer(0, 0.1, 0.1, 4), 4, True)
    assert capacity_of([whole, *refused], 0.0, 1.0, min_window_s=0.5).refused == 3
    with pytest.raises(CapacityError, match="no answer completed"):
        capacity_of(refused, 0.0, 1.0, min_window_s=0.5)


def test_the_steady_rate_is_a_share_of_the_capacity_with_a_floor():
    assert command.steady_rate(25.0) == 4.0  # the host the scenarios were written on
    assert command.steady_rate(3.5) == 1.0  # an AVX2 host: at least one a second ...
    assert command.steady_rate(1.0) == 0.5  # ... but never past half the capacity


def args(**kw) -> argparse.Namespace:
    base = dict(
        capacity=None, rate=None, prompt_len="24", output_len="128", duration=60.0,
        model="m", replicas=2, gateway=None, replica=[], model_name="demo", deadline=20.0,
        seed=0, work_dir=None, gateway_defaults=True,
    )  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_the_capacity_is_measured_only_where_it_is_needed(monkeypatch):
    asked = []

    def measure(setup, lengths, log):
        asked.append(setup)
        raise CapacityError("measured")

    monkeypatch.setattr(command, "measure_capacity", measure)
    plan = command._plan(args(capacity=10.0), ["flood"])
    assert (plan.capacity, plan.rate, plan.capacity_measured) == (10.0, 1.6, False)
    plan = command._plan(args(rate=2.0), ["kill-replica"])  # neither rate nor flood needs it
    assert (plan.rate, plan.capacity_measured) == (2.0, False)
    assert not asked
    with pytest.raises(SystemExit, match="capacity: measured"):
        command._plan(args(rate=2.0), ["flood"])
    with pytest.raises(SystemExit, match="capacity: measured"):
        command._plan(args(), ["kill-replica"])
    assert len(asked) == 2


def test_stopping_a_group_that_has_already_ended_is_no_error():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    assert stop_group(proc, 5) == 0
