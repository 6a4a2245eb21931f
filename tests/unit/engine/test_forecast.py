"""The slot forecast: when the k-th waiting request gets a running slot."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poise.engine.forecast import SlotForecaster


def test_free_slots_mean_no_wait() -> None:
    f = SlotForecaster(max_num_seqs=4)
    f.observe_step(0.05)
    fc = f.forecast([(10, 64), (20, 64)])
    assert fc.free_slots == 2
    assert fc.wait_s(1) == 0.0 and fc.wait_s(2) == 0.0
    # The third in line waits for the request closest to its end: 64 - 20 steps.
    assert fc.wait_s(3) == pytest.approx(44 * 0.05)


def test_a_cap_still_growing_lets_a_burst_in_two_steps_apiece() -> None:
    """A step-time budget's cap that stands where demand stopped, not where the budget holds:
    a burst beyond it starts one per two steps (admitted as a prompt chunk, counted once it
    decodes); it does not wait for running requests to end (the wait that refused a
    failed-over stream on a replica with room to spare)."""
    f = SlotForecaster(max_num_seqs=64)
    f.observe_step(0.01)
    running = [(2, 16)] * 3
    held = f.forecast(running, max_running=3)
    assert held.wait_s(1) == pytest.approx(14 * 0.01)
    growing = f.forecast(running, max_running=3, cap_grows=True)
    assert growing.wait_s(1) == pytest.approx(2 * 0.01)
    assert growing.wait_s(6) == pytest.approx(12 * 0.01)
    assert growing.wait_s(40) == pytest.approx(80 * 0.01)
    # Never later than running requests' ends would free slots, and only up to max_num_seqs.
    ending = f.forecast([(15, 16)] * 3, max_running=3, cap_grows=True)
    assert ending.wait_s(7) == pytest.approx(3 * 0.01)  # one step to end, then 2 cycles of 1
    full = f.forecast([(2, 16)] * 64, max_running=64, cap_grows=True)
    assert full.growth_slots == 0 and full.wait_s(1) == pytest.approx(14 * 0.01)


def test_a_synchronised_batch_makes_the_next_request_wait_for_the_whole_wave() -> None:
    """Requests that started together end together: an average start rate would say 'soon'."""
    f = SlotForecaster(max_num_seqs=8)
    f.observe_step(0.06)
    fc = f.forecast([(2, 64)] * 8)
    assert fc.wait_s(1) == pytest.approx(62 * 0.06)
    assert fc.wait_s(8) == pytest.approx(62 * 0.06)
    # The ninth must wait for a slot freed by someone who started after this wave: a cycle on.
    f.observe_finished(64)
    fc = f.forecast([(2, 64)] * 8)
    assert fc.wait_s(9) == pytest.approx((62 + 64) * 0.06)


def test_typical_output_length_tempers_a_huge_max_tokens() -> None:
    f = SlotForecaster(max_num_seqs=1)
    f.observe_step(0.1)
    for _ in range(50):
        f.observe_finished(20)
    fc = f.forecast([(5, 4000)])
    assert fc.wait_s(1) == pytest.approx(15 * 0.1)
    # Past its typical length a request may end any step now, but not before a step.
    assert f.forecast([(30, 4000)]).wait_s(1) == pytest.approx(0.1)


@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(1, 200)), max_size=16),
    st.integers(1, 16),
)
def test_waits_never_decrease_along_the_line(running, max_num_seqs) -> None:
    f = SlotForecaster(max_num_seqs=max(max_num_seqs, len(running)))
    f.observe_step(0.01)
    fc = f.forecast([(min(p, m - 1), m) for p, m in running])
    waits = [fc.wait_s(k) for k in range(1, 40)]
    assert all(a <= b for a, b in itertools.pairwise(waits))
    assert all(w >= 0 for w in waits)
