"""The bench's arithmetic on hand-made records: every number is known in advance."""

from __future__ import annotations

import itertools
import random

import pytest

from poise.bench.report import SLO, Record, Stats, summarize
from poise.bench.workload import Lengths, arrival_times


def ok(ttft: float, e2e: float, tokens: int, sent: float = 0.0) -> Record:
    return Record(sent, 200, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens)


def test_tpot_is_decode_time_per_token_after_the_first():
    assert ok(0.5, 2.5, 5).tpot_s == pytest.approx(0.5)  # (2.5 - 0.5) / (5 - 1)
    assert ok(0.5, 0.5, 1).tpot_s is None  # one token: no decode time to divide
    assert Record(0, 429).tpot_s is None


def test_percentiles_interpolate_like_numpy():
    s = Stats.of([1.0, 2.0, 3.0, 4.0])
    assert s is not None
    assert (s.mean, s.p50, s.p90) == (2.5, 2.5, pytest.approx(3.7))
    assert s.p99 == pytest.approx(3.97)
    assert Stats.of([]) is None


def test_goodput_counts_only_completed_requests_meeting_every_slo():
    records = [
        ok(0.2, 1.2, 11),  # TPOT 0.1: meets ttft<=0.5, tpot<=0.1
        ok(0.3, 2.3, 11),  # TPOT 0.2: misses tpot
        ok(0.9, 1.9, 11),  # misses ttft
        ok(0.1, 0.6, 6),  # TPOT 0.1: meets
        Record(0.0, 429, error="overloaded"),  # rejected: never good, never hidden
        Record(0.0, 503, error="draining"),
        Record(0.0, 200, ttft_s=0.1, error="the stream ended without [DONE]"),  # failed
        Record(0.0, 0, error="ClientConnectorError"),  # failed
    ]
    s = summarize(records, duration_s=4.0, slo=SLO.parse("ttft=500ms,tpot=0.1"))
    assert (s.sent, s.completed, s.rejected, s.failed) == (8, 4, 2, 2)
    assert s.slo_attainment == pytest.approx(2 / 4)  # among completed
    assert s.goodput == pytest.approx(2 / 4.0)  # per second of the run
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_token_throughput == pytest.approx((11 + 11 + 11 + 6) / 4.0)
    assert s.ttft is not None and s.ttft.p50 == pytest.approx(0.25)


def test_shedding_lowers_goodput_even_when_attainment_is_perfect():
    served = [ok(0.1, 0.5, 5) for _ in range(10)]
    shed = [Record(0.0, 429) for _ in range(90)]
    s = summarize(served + shed, duration_s=10.0, slo=SLO(ttft_s=1.0))
    assert s.slo_attainment == 1.0 and s.goodput == pytest.approx(1.0) and s.rejected == 90


def test_slo_and_length_parsing_say_what_is_wrong():
    assert SLO.parse("ttft=1,e2e=20") == SLO(ttft_s=1.0, e2e_s=20.0)
    with pytest.raises(ValueError, match="ttft="):
        SLO.parse("latency=1")
    assert Lengths.parse("128:512") == Lengths(128, 512)
    with pytest.raises(ValueError, match="LOW:HIGH"):
        Lengths.parse("512:128")


def test_arrivals_keep_the_rate_and_repeat_with_the_seed():
    times = arrival_times(4000, [20.0], 0.0, 1.0, random.Random(7))
    assert times == arrival_times(4000, [20.0], 0.0, 1.0, random.Random(7))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.05)
    bursty = arrival_times(4000, [20.0], 0.0, 0.25, random.Random(7))
    bgaps = [b - a for a, b in itertools.pairwise(bursty)]
    # Same mean, more spread: a burstiness below 1 clumps arrivals.
    assert sum(bgaps) / len(bgaps) == pytest.approx(1 / 20, rel=0.1)
    assert _cv(bgaps) > 1.5 * _cv(gaps)
    ramp = arrival_times(600, [5.0, 50.0], 10.0, 1.0, random.Random(1))
    first = sum(1 for t in ramp if t < 10)
    assert 35 <= first <= 65  # about 5/s for the first 10 s, then 50/s


def _cv(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5 / mean


def test_a_rate_that_sheds_does_not_count_as_sustained():
    from poise.bench.command import format_sweep, sustained

    calm = summarize([ok(0.1, 0.5, 5) for _ in range(10)], 1.0, SLO(ttft_s=1.0))
    shedding = summarize(
        [ok(0.1, 0.5, 5) for _ in range(10)] + [Record(0.0, 429) for _ in range(10)],
        1.0,
        SLO(ttft_s=1.0),
    )
    assert sustained(calm) == 1.0 and shedding.slo_attainment == 1.0
    assert sustained(shedding) == 0.5  # perfect among the served, half of all sent
    assert format_sweep([(10, calm), (20, shedding)]).endswith(": 10 req/s")
