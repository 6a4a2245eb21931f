"""What a deployment serves at the steady lengths, measured on the host at hand.

A chaos run's load is a share of the deployment's capacity, and its flood a multiple of it: a
fixed number of requests per second is a light load on one CPU and an overload on another (the
demo model's two replicas serve 25 req/s on an AMX host and about a sixth of that on an
AVX2-only one), and a run whose steady traffic already overloads the host before the fault
measures the host, not the fault. So unless ``--capacity`` is given, chaos measures it first:
a closed loop of ``CLIENTS_PER_REPLICA`` clients per replica (what ``poise bench
--concurrency 48`` is for two) sends the steady lengths back to back, and the capacity is the
token events streamed per second in the window after the first wave's prefills, over the
events a whole answer takes. Events rather than completed answers, because a closed loop's
answers finish in waves, and a window of a few of them counts one wave more or less.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from poise.bench.client import SendOptions, auth_headers, client_session, request_body, send
from poise.bench.report import Record
from poise.bench.workload import Lengths, synthetic

CLIENTS_PER_REPLICA = 24
# The steady rate when none is given: 4 req/s of the 25 the demo model's replicas serve on the
# host its scenarios were written on, a load each replica serves with a short batch.
LOAD_SHARE = 0.16
_REFUSED_PAUSE_S = 0.5  # a refused client waits this long before it asks again


@dataclass(frozen=True, slots=True)
class Calibration:
    """How capacity is measured: ``clients`` in a closed loop, counted from ``warm_s`` to
    ``warm_s + window_s``."""

    clients: int
    warm_s: float = 5.0
    window_s: float = 20.0


@dataclass(frozen=True, slots=True)
class Capacity:
    rps: float  # requests per second served at the steady lengths
    events_per_s: float
    events_per_answer: float
    answers: int  # whole answers the measurement saw (what events_per_answer comes from)
    refused: int  # requests refused during it (a closed loop past what the gateway admits)


def capacity_of(records: Sequence[Record], start_s: float, end_s: float) -> Capacity:
    """The capacity the records show in ``[start_s, end_s)`` of the run's clock."""
    events = sum(1 for r in records for t in event_times(r) if start_s <= t < end_s)
    whole = [1 + len(r.itl_s) for r in records if r.completed and r.ttft_s is not None]
    if not whole or end_s <= start_s:
        raise ValueError("no answer completed during the measurement: the deployment serves none")
    per_s = events / (end_s - start_s)
    per_answer = sum(whole) / len(whole)
    refused = sum(1 for r in records if r.rejected)
    return Capacity(per_s / per_answer, per_s, per_answer, len(whole), refused)


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
    url: str,
    model: str,
    lengths: tuple[Lengths, Lengths],
    calibration: Calibration,
    api_key: str | None = None,
) -> Capacity:
    """A closed loop against the gateway at ``url``; what it served per second."""
    end = calibration.warm_s + calibration.window_s
    rng = random.Random(0)
    headers = auth_headers(api_key)
    records: list[Record] = []
    async with client_session() as session:
        t0 = time.perf_counter()

        async def client() -> None:
            while (left := end - (time.perf_counter() - t0)) > 0:
                (item,) = synthetic(1, *lengths, rng)
                body = request_body(model, item, chat=False, ignore_eos=True)
                # Walked away from at the window's end: what it streamed until then counts.
                options = SendOptions(timeout_s=left + 1.0, abandon_after_s=left)
                record = await send(session, url + "/v1/completions", body, headers, t0, options)
                records.append(record)
                if record.status != 200:
                    await asyncio.sleep(min(left, _REFUSED_PAUSE_S))

        # All at once, as ``poise bench --concurrency`` and ``vllm bench serve`` start.
        await asyncio.gather(*(client() for _ in range(calibration.clients)))
    return capacity_of(records, calibration.warm_s, end)
