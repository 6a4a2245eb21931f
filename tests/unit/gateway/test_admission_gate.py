"""The gateway's admission queue over a real Pool: capacity from in-flight and reported load,
best priority first when room appears, shedding, a full queue, deadlines and TTLs."""

from __future__ import annotations

import asyncio

import pytest

from poise.gateway.admission import PoolGate
from poise.gateway.config import GatewaySettings
from poise.gateway.pool import Pool
from poise.protocol import APIError


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def gate(clock: Clock, n: int = 1, **admission) -> PoolGate:
    backends = [{"url": f"http://127.0.0.1:{9000 + i}"} for i in range(n)]
    settings = GatewaySettings.model_validate(
        {"models": {"m": {"backends": backends}}, "admission": admission}
    )
    refusals: list[str] = []
    g = PoolGate(
        Pool("m", settings, clock), settings.admission, clock, lambda m, r: refusals.append(r)
    )
    g.refusals = refusals  # type: ignore[attr-defined]
    return g


async def test_capacity_counts_reports_while_fresh_or_while_probes_pass():
    clock = Clock()
    g = gate(clock, n=2, max_inflight_per_backend=4, max_backend_waiting=10)
    assert g.capacity() == 8  # never reported: bounded by in-flight alone
    a, b = g.pool.backends
    a.load.at = b.load.at = a.passed_at = b.passed_at = clock.now
    a.load.waiting = 12  # says it is full
    assert g.capacity() == 4
    clock.now += 60  # silent since, reports and probes alike (hung): saturated
    assert g.capacity() == 0
    # B's probes pass again but its metrics stay unread (an endpoint slow under load): its
    # last report, which had room, still counts. A's said it was full, and still does.
    a.passed_at = b.passed_at = clock.now
    assert g.capacity() == 4
    clock.now += 60  # every backend down: panic routing keeps them, admission does not
    a.healthy = b.healthy = False
    assert g.pool.in_panic and g.capacity() == 0


async def test_waiting_requests_go_best_priority_first():
    clock = Clock()
    g = gate(clock, max_inflight_per_backend=1)
    await g.enter(0, clock.now + 30)  # takes the only place
    order: list[str] = []

    async def wait(name: str, prio: int) -> None:
        await g.enter(prio, clock.now + 30)
        order.append(name)

    tasks = [asyncio.create_task(wait("low", 5)), asyncio.create_task(wait("high", 0))]
    await asyncio.sleep(0.01)
    assert len(g.line) == 2 and order == []
    g.leave(0)
    await asyncio.sleep(0.01)
    assert order == ["high"]
    g.leave(0)
    await asyncio.gather(*tasks)
    assert order == ["high", "low"] and g.admitted == 1


async def test_full_queue_sheds_lower_priority_with_429_and_refuses_with_503():
    clock = Clock()
    g = gate(clock, max_inflight_per_backend=1, max_queue=1)
    await g.enter(0, clock.now + 30)
    low = asyncio.create_task(g.enter(5, clock.now + 30))
    await asyncio.sleep(0.01)
    high = asyncio.create_task(g.enter(0, clock.now + 30))
    await asyncio.sleep(0.01)
    with pytest.raises(APIError) as shed:
        await low
    assert shed.value.status == 429 and shed.value.headers["Retry-After"] == "1"
    with pytest.raises(APIError) as full:
        await g.enter(3, clock.now + 30)
    assert full.value.status == 503 and full.value.code == "queue_full"
    g.leave(0)
    await high
    assert g.refusals == ["shed", "queue_full"]  # type: ignore[attr-defined]


async def test_deadline_and_ttl_end_a_wait():
    clock = Clock()
    g = gate(clock, max_inflight_per_backend=1, queue_ttl_s=5)
    await g.enter(0, clock.now + 30)
    with pytest.raises(APIError) as late:
        await g.enter(0, clock.now + 0.05)  # deadline on the injected clock, waited for real
    assert late.value.status == 504 and len(g.line) == 0
    waiting = asyncio.create_task(g.enter(0, clock.now + 300))
    await asyncio.sleep(0.01)
    clock.now += 6  # past the TTL: the pump refuses it
    with pytest.raises(APIError) as expired:
        await waiting
    assert expired.value.status == 429 and expired.value.code == "queue_ttl"


async def test_a_client_that_leaves_gives_its_place_back():
    clock = Clock()
    g = gate(clock, max_inflight_per_backend=1)
    await g.enter(0, clock.now + 30)
    waiting = asyncio.create_task(g.enter(0, clock.now + 30))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(g.line) == 0 and g.admitted == 1
    g.leave(0)
    assert g.admitted == 0


async def test_a_place_given_as_the_deadline_fires_is_given_back():
    """Admitted and timed out in the same loop pass: the 504 must not keep the place."""
    clock = Clock()
    g = gate(clock, max_inflight_per_backend=1)
    await g.enter(0, clock.now + 30)  # takes the only place
    late = asyncio.create_task(g.enter(0, clock.now))  # its deadline has passed: times out now
    await asyncio.sleep(0)  # it waits in the line, its timeout due in the next loop pass
    g.leave(0)  # ... and in this pass the place goes to it
    with pytest.raises(APIError) as err:
        await late
    assert err.value.status == 504
    assert g.admitted == 0  # nobody holds a place
    await g.enter(0, clock.now + 30)  # and the next request gets it at once
    assert g.admitted == 1


async def test_batch_work_that_fills_the_pool_holds_no_better_priority_back():
    """Capacity counts what is let through of a priority at least as good: a flood of batch
    work (priority 10) at capacity leaves room for an interactive request (priority 0), which
    the replicas schedule first; more batch work waits, and goes when one finishes."""
    clock = Clock()
    g = gate(clock, max_inflight_per_backend=2)
    for _ in range(2):
        await g.enter(10, clock.now + 30)
    assert g.saturated and g.saturated_for(10) and not g.saturated_for(0)
    more_batch = asyncio.create_task(g.enter(10, clock.now + 30))
    await asyncio.sleep(0.01)
    assert len(g.line) == 1
    await asyncio.wait_for(g.enter(0, clock.now + 30), 1)  # straight through
    await g.enter(0, clock.now + 30)
    assert g.saturated_for(0) and g.admitted == 4
    interactive = asyncio.create_task(g.enter(0, clock.now + 30))  # two ahead of its kind
    await asyncio.sleep(0.01)
    g.leave(10)  # a batch request ends: room for batch again, the interactive one goes first
    await asyncio.sleep(0.01)
    assert not more_batch.done() and not interactive.done()  # 0-priority still at capacity
    g.leave(0)
    await asyncio.wait_for(interactive, 1)
    g.leave(0)  # batch competes with everything let through: 1 batch + 1 interactive
    await asyncio.sleep(0.01)
    assert not more_batch.done()
    g.leave(10)
    await asyncio.wait_for(more_batch, 1)
    assert g.admitted == 2 and len(g.line) == 0


async def test_a_patient_objective_is_not_held_for_shedding_and_none_waits_past_its_own():
    # Every backend refused priority 0 for load twice, sparing objectives of 2 s or more: a
    # request that says nothing, or asks 1 s, is refused here; one that brings 5 s goes on.
    clock = Clock()
    g = gate(clock, 2, max_inflight_per_backend=1)
    for b in g.pool.backends:
        b.note_shedding(0, clock.now, 0.25, spares_s=2.0)
        b.note_shedding(0, clock.now, 0.25, spares_s=2.0)
    for first_token_by in (None, clock.now + 1.0):
        with pytest.raises(APIError) as refused:
            await g.enter(0, clock.now + 10, first_token_by)
        assert refused.value.status == 429
    assert g.refusals == ["shedding", "shedding"]  # type: ignore[attr-defined]
    await g.enter(0, clock.now + 10, clock.now + 5.0)
    await g.enter(0, clock.now + 10, clock.now + 5.0)
    assert g.admitted == 2  # the pool's capacity: a third waits in line ...
    clock.now += 0.3  # (the backends no longer shed)
    with pytest.raises(APIError) as late:
        await g.enter(0, clock.now + 10, clock.now + 0.05)  # ... no longer than its objective
    assert late.value.status == 429 and late.value.code == "slo_ttft"
    assert g.refusals[-1] == "slo_ttft" and g.admitted == 2  # type: ignore[attr-defined]
