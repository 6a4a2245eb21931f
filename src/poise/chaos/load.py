"""Chaos's load: the scenario's traffic as timed requests, sent as a patient client would.

Every request carries a deadline (``X-Request-Deadline-Ms``) and the client waits that long
plus a grace before it calls the request hung. Like the OpenAI SDK, it sends again when the
connection fails before any answer began (a gateway restarting), until the deadline. Requests
of an abandoning traffic walk away at a random point of their expected life.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from poise.bench.client import SendOptions, auth_headers, client_session, request_body, send
from poise.bench.report import Record
from poise.bench.workload import Item, synthetic
from poise.chaos.scenarios import Traffic
from poise.protocol import DEADLINE_HEADER


@dataclass(frozen=True, slots=True)
class Planned:
    at_s: float
    traffic: Traffic
    item: Item
    abandon_after_s: float | None = None


@dataclass(slots=True)
class Sent:
    planned: Planned
    record: Record


def schedule(traffics: list[Traffic], rng: random.Random) -> list[Planned]:
    """Every request of every traffic, in sending order."""
    out: list[Planned] = []
    for traffic in traffics:
        t = traffic.start_s + rng.expovariate(traffic.rate)
        times = []
        while t < traffic.end_s:
            times.append(t)
            t += rng.expovariate(traffic.rate)
        items = synthetic(len(times), traffic.prompt_len, traffic.output_len, rng)
        for at, item in zip(times, items, strict=True):
            abandon = None
            if rng.random() < traffic.abandon_share:
                # Somewhere in a request's life: before its first token as well as mid-stream.
                abandon = rng.uniform(0.02, 0.02 * item.max_tokens)
            out.append(Planned(at, traffic, item, abandon))
    out.sort(key=lambda p: p.at_s)
    return out


async def drive(
    url: str,
    model: str,
    planned: list[Planned],
    deadline_s: float,
    grace_s: float,
    keys: dict[str, str],
    t0: float,
    on_done: Callable[[Sent], None] | None = None,
) -> list[Sent]:
    """Send each request at its time (open loop) and wait for every answer.

    ``keys``: API key name to secret; ``t0``: the run's start (perf_counter).
    """
    endpoint = url.rstrip("/") + "/v1/completions"
    async with client_session() as session:

        async def one(p: Planned) -> Sent:
            key = None if p.traffic.key is None else keys[p.traffic.key]
            headers = {DEADLINE_HEADER: str(int(deadline_s * 1000)), **auth_headers(key)}
            options = SendOptions(
                timeout_s=deadline_s + grace_s,
                retry_connect=True,
                abandon_after_s=p.abandon_after_s,
            )
            body = request_body(model, p.item, chat=False, ignore_eos=True)
            sent = Sent(p, await send(session, endpoint, body, headers, t0, options))
            if on_done is not None:
                on_done(sent)
            return sent

        tasks = []
        for p in planned:
            delay = t0 + p.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(p)))
        return list(await asyncio.gather(*tasks))
