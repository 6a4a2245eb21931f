"""Chaos measures a real server's capacity with a closed loop: answers of the asked length,
a rate that agrees with the answers the loop saw, and nothing refused."""

from __future__ import annotations

import asyncio

import pytest

from poise.bench.workload import Lengths
from poise.chaos.capacity import Calibration, CapacityError, measure


def test_a_closed_loop_measures_what_the_server_serves(server):
    lengths = (Lengths(8), Lengths(16))
    calibration = Calibration(clients=4, warm_s=1.0, window_s=4.0, min_window_s=2.0)
    found = asyncio.run(measure(server.url, "m", lengths, calibration))
    # An event is a token with text: the tiny model's tokenizer has some without.
    assert found.refused == 0 and 12 <= found.events_per_answer <= 16
    # Four clients back to back for 5 s: the whole answers seen bound the rate from below,
    # and four answers streaming all the time from above (each at least a step a token).
    assert found.answers >= 4
    assert 0.6 * found.answers / 5.0 <= found.rps <= 4 / (16 * 0.001)


def test_a_deployment_that_answers_with_errors_is_named_at_once(server):
    calibration = Calibration(clients=2, warm_s=1.0, window_s=20.0, min_window_s=2.0)
    with pytest.raises(CapacityError, match="404"):
        asyncio.run(
            asyncio.wait_for(
                measure(server.url, "no-such-model", (Lengths(8), Lengths(16)), calibration), 10
            )
        )
