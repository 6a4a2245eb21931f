"""Driving the load: open-loop arrivals or a fixed concurrency, a live count, the results file."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from poise.bench.client import SendOptions, auth_headers, client_session, request_body, send
from poise.bench.report import Record, Summary
from poise.bench.workload import Item


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # the server's base URL, without /v1
    model: str
    api_key: str | None = None
    chat: bool = False
    ignore_eos: bool = False
    timeout_s: float = 600.0

    @property
    def endpoint(self) -> str:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        return self.url.rstrip("/") + path

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)


class Progress:
    """Completed / failed / rejected, live on the terminal (tqdm), and nothing when off."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, unit="req", disable=not enabled, dynamic_ncols=True)
        self.counts = {"ok": 0, "failed": 0, "rejected": 0}

    def done(self, r: Record) -> None:
        kind = "ok" if r.completed else "rejected" if r.rejected else "failed"
        self.counts[kind] += 1
        self.bar.set_postfix(self.counts, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def run(
    target: Target,
    items: Sequence[Item],
    arrivals: Sequence[float] | None = None,
    concurrency: int | None = None,
    progress: bool = False,
) -> tuple[list[Record], float]:
    """Send every item, at ``arrivals`` (open loop) or ``concurrency`` at a time (closed loop).

    Returns the records in sending order and the run's duration (first send to last answer).
    """
    if (arrivals is None) == (concurrency is None):
        raise ValueError("give arrival times or a concurrency, not both")
    bar = Progress(len(items), progress)
    options = SendOptions(timeout_s=target.timeout_s)
    async with client_session() as session:
        t0 = time.perf_counter()

        def one(item: Item) -> Awaitable[Record]:
            body = request_body(target.model, item, target.chat, target.ignore_eos)
            return send(session, target.endpoint, body, target.headers, t0, options)

        try:
            if arrivals is not None:
                records = await _open_loop(items, arrivals, one, bar.done, t0)
            else:
                assert concurrency is not None
                records = await _closed_loop(items, concurrency, one, bar.done)
        finally:
            bar.close()
        return records, time.perf_counter() - t0


async def _open_loop(
    items: Sequence[Item],
    arrivals: Sequence[float],
    one: Callable[[Item], Awaitable[Record]],
    done: Callable[[Record], None],
    t0: float,
) -> list[Record]:
    async def timed(item: Item) -> Record:
        record = await one(item)
        done(record)
        return record

    tasks = []
    for item, at in zip(items, arrivals, strict=True):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(timed(item)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(
    items: Sequence[Item],
    concurrency: int,
    one: Callable[[Item], Awaitable[Record]],
    done: Callable[[Record], None],
) -> list[Record]:
    records: list[Record | None] = [None] * len(items)
    next_index = iter(range(len(items)))

    async def worker() -> None:
        for i in next_index:
            records[i] = await one(items[i])
            done(records[i])  # type: ignore[arg-type]

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in records if r is not None]


def write_results(
    path: Path, records: list[Record], summary: Summary, settings: dict[str, object]
) -> None:
    path.write_text(
        json.dumps(
            {
                "settings": settings,
                "summary": summary.as_dict(),
                "requests": [asdict(r) for r in records],
            },
            indent=1,
        )
    )
