"""Chaos's capacity arithmetic: token events in the window over the events of a whole answer."""

from __future__ import annotations

import pytest

from poise.bench.report import Record
from poise.chaos.capacity import capacity_of, event_times


def answer(sent_at: float, ttft: float, gap: float, events: int, whole: bool = True) -> Record:
    record = Record(sent_at=sent_at, status=200, ttft_s=ttft, itl_s=[gap] * (events - 1))
    if whole:
        record.e2e_s = ttft + gap * (events - 1)
    else:
        record.abandoned, record.error = True, "abandoned by the client"
    return record


def test_event_times_are_on_the_runs_clock():
    assert event_times(answer(2.0, 0.5, 0.25, 3)) == [2.5, 2.75, 3.0]
    assert event_times(Record(sent_at=1.0, status=429)) == []


def test_the_window_counts_events_not_answers():
    # Two clients, answers of 10 events 0.1 s apart, back to back from t=0 for 6 s; the
    # last answer of each is cut at the window's end (walked away from) and its events count.
    records = []
    for _ in range(2):
        t = 0.0
        for _ in range(5):
            records.append(answer(t, 0.1, 0.1, 10))
            t += 1.0
        records.append(answer(t, 0.1, 0.1, 9, whole=False))
    found = capacity_of(records, 1.0, 6.0)
    # 10 events a second per client; 10 events an answer: one answer a second per client.
    assert found.events_per_answer == 10
    assert found.rps == pytest.approx(2.0, rel=0.05)
    assert found.answers == 10 and found.refused == 0


def test_refusals_are_counted_and_no_answer_is_no_capacity():
    refused = [Record(sent_at=0.1 * i, status=429) for i in range(3)]
    assert capacity_of([answer(0, 0.1, 0.1, 4), *refused], 0.0, 1.0).refused == 3
    with pytest.raises(ValueError, match="no answer completed"):
        capacity_of(refused, 0.0, 1.0)
