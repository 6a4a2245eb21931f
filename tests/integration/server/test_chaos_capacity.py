"""Chaos measures a real server's capacity with a closed loop: whole answers of the asked
length, a rate that agrees with the answers the loop saw, and nothing refused."""

from __future__ import annotations

import asyncio

from poise.bench.workload import Lengths
from poise.chaos.capacity import Calibration, measure


def test_a_closed_loop_measures_what_the_server_serves(server):
    lengths = (Lengths(8), Lengths(16))
    calibration = Calibration(clients=4, warm_s=1.0, window_s=4.0)
    found = asyncio.run(measure(server.url, "m", lengths, calibration))
    assert found.refused == 0
    assert found.answers >= 4 and 15 <= found.events_per_answer <= 16
    # Four clients back to back for 5 s: the answers seen bound the rate from below.
    assert found.rps >= 0.6 * found.answers / 5.0
    assert found.rps == found.events_per_s / found.events_per_answer
