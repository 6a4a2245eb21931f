"""What a deployment serves at the steady lengths, measured on the host at hand.

A chaos run's load is a share of the deployment's capacity, and its flood a multiple of it: a
fixed number of requests per second is a light load on one CPU and an overload on another (the
demo model's two replicas serve 25 req/s on an AMX host and about 3.5 on an
AVX2-only one), and a run whose steady traffic already overloads the host before the fault
measures the host, not the fault. So unless ``--capacity`` is given, chaos measures it first:
a closed loop of ``CLIENTS_PER_REPLICA`` clients per replica (what ``poise bench
--concurrency 48`` is for two) sends the steady lengths back to back, and the capacity is the
token events streamed per second in the window after the first wave's prefills (from when
every client has its first token), over the events a whole answer of the asked length takes
(answers run to their ``max_tokens``: ``ignore_eos``). Events rather than completed answers,
because a closed loop's answers finish in waves, and a window of a few of them counts one wave
more or less; the asked lengths rather than the answers that completed, because of a range of
lengths the short ones complete first. Each request says it will wait out the window for its
first token (``x-slo-ttft-ms``): a patient client, which replicas hold to that objective rather
than to their queue target, so the loop is not refused for the queue its own next wave makes.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from poise.bench.client import SendOptions, client_session, request_body, send
from poise.bench.report import Record
from poise.bench.workload import Lengths, synthetic
from poise.protocol import TTFT_SLO_HEADER

CLIENTS_PER_REPLICA = 24
# The steady rate when none is given: 4 req/s of the 25 the demo model's replicas serve on the
# host its scenarios were written on, a load each replica serves with a short batch.
LOAD_SHARE = 0.16
MIN_RATE = 1.0  # ... and at least this, where that is no more than half the capacity
_REFUSED_PAUSE_S = 0.5  # a refused client waits this long before it asks again


class CapacityError(RuntimeError):
    """The deployment cannot be measured: it answers with errors, or serves nothing in time."""


@dataclass(frozen=True, slots=True)
class Calibration:
    """How capacity is measured: ``clients`` in a closed loop for ``warm_s + window_s``,
    counted from ``warm_s`` at the earliest (later if the first wave streams later)."""

    clients: int
    warm_s: float = 5.0
    window_s: float = 20.0
    min_window_s: float = 5.0  # counted for less than this, the measure says nothing


@dataclass(frozen=True, slots=True)
class Sent:
    """One request of the loop: what the client saw, and the tokens it asked for."""

    record: Record
    max_tokens: int
    first_of_client: bool = False


@dataclass(frozen=True, slots=True)
class Capacity:
    rps: float  # requests per second served at the steady lengths
    events_per_s: float
    events_per_answer: float
    answers: int  # whole answers the measurement saw
    refused: int  # requests refused during it (a closed loop past what the gateway admits)
    window_s: float  # how long it counted


def capacity_of(
    sent: Sequence[Sent], start_s: float, end_s: float, min_window_s: float
) -> Capacity:
    """The capacity the requests show in ``[start_s, end_s)`` of the run's clock, the start
    put off until every client's first answer has begun to stream."""
    firsts = [s.record for s in sent if s.first_of_client and s.record.ttft_s is not None]
    if firsts:
        start_s = max([start_s, *(r.sent_at + (r.ttft_s or 0.0) for r in firsts)])
    whole = [s for s in sent if s.record.completed]
    if not whole:
        raise CapacityError("no answer completed during the measurement: give --capacity")
    if end_s - start_s < min_window_s:
        raise CapacityError(
            f"the first answers began {start_s:.1f}s into a {end_s:g}s measurement, too late "
            "to measure: give --capacity"
        )
    events = sum(1 for s in sent for t in event_times(s.record) if start_s <= t < end_s)
    per_token = sum(1 + len(s.record.itl_s) for s in whole) / sum(s.max_tokens for s in whole)
    per_answer = per_token * sum(s.max_tokens for s in sent) / len(sent)
    per_s = events / (end_s - start_s)
    if per_s <= 0:
        raise CapacityError("nothing streamed in the measurement's window: give --capacity")
    refused = sum(1 for s in sent if s.record.rejected)
    return Capacity(per_s / per_answer, per_s, per_answer, len(whole), refused, end_s - start_s)


def event_times(record: Record) -> list[float]:
    """When each streamed event of a record arrived, on the run's clock."""
    if record.ttft_s is None:
        return []
    t = record.sent_at + record.ttft_s
    out = [t]
    for gap in record.itl_s:
        t += gap
        out.append(t)
    return out


async def measure(
    url: str, model: str, lengths: tuple[Lengths, Lengths], calibration: Calibration
) -> Capacity:
    """A closed loop against the gateway at ``url``; what it served per second."""
    end = calibration.warm_s + calibration.window_s
    rng = random.Random(0)
    sent: list[Sent] = []
    async with client_session() as session:
        t0 = time.perf_counter()

        async def client() -> None:
            first = True
            while (left := end - (time.perf_counter() - t0)) > 0:
                (item,) = synthetic(1, *lengths, rng)
                body = request_body(model, item, chat=False, ignore_eos=True)
                # Walked away from at the window's end: what it streamed until then counts.
                options = SendOptions(timeout_s=left + 1.0, abandon_after_s=left)
                patient = {TTFT_SLO_HEADER: str(round(1000 * end))}
                record = await send(session, url + "/v1/completions", body, patient, t0, options)
                sent.append(Sent(record, item.max_tokens, first))
                first = first and record.ttft_s is None
                if record.rejected:
                    await asyncio.sleep(min(left, _REFUSED_PAUSE_S))
                elif not record.completed and not record.abandoned:
                    raise CapacityError(
                        f"a request of the measurement failed ({record.status or 'no answer'}):"
                        f" {record.error}"
                    )

        # All at once, as ``poise bench --concurrency`` and ``vllm bench serve`` start.
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(calibration.clients):
                    group.create_task(client())
        except ExceptionGroup as group_error:  # the first client's failure stopped them all
            failed = group_error.subgroup(CapacityError)
            if failed is None:
                raise
            raise failed.exceptions[0] from None
    return capacity_of(sent, calibration.warm_s, end, calibration.min_window_s)
