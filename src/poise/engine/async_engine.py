"""The engine for an asyncio server: the step loop in its own thread, outputs as async streams.

The loop thread owns the ``LLMEngine``; other threads reach it only through the command queue
(add, abort), so scheduler state is never shared. Validation runs in the caller's thread
(``LLMEngine.prepare_request`` is side-effect free), so bad input fails at once. A consumer
that stops iterating (client gone, task cancelled) aborts its request, which frees its blocks
at the next step. ``last_progress`` lets a watchdog tell a working loop from a stuck one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from poise.engine.engine import LLMEngine
from poise.engine.errors import EngineDeadError
from poise.engine.outputs import RequestOutput
from poise.engine.request import Request, SamplingParams

log = logging.getLogger("poise.engine")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05, niceness: int = 0) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Request | str, str | None]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._idle_wait_s = idle_wait_s
        self.niceness = niceness
        self.dead_reason: str | None = None
        self._last_turn = time.monotonic()  # every loop turn, idle or not; for a watchdog

    # ----- owner -----
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="poise-engine", daemon=True)
        self._thread.start()

    async def aclose(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    @property
    def last_progress(self) -> float:
        """Monotonic time the loop last finished a turn (a step, or an idle wait)."""
        return self._last_turn

    @property
    def has_work(self) -> bool:
        return bool(self._streams)

    # ----- requests -----
    def prepare(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        add_special_tokens: bool = True,
        is_probe: bool = False,
    ) -> tuple[Request, str | None]:
        """Validate and tokenize in the caller's thread; raises on bad input, submits nothing."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        return self.engine.prepare_request(
            prompt, sampling, request_id, priority, deadline, add_special_tokens, is_probe
        )

    async def stream(self, request: Request, text: str | None) -> AsyncIterator[RequestOutput]:
        """Submit a prepared request; its outputs until it finishes. Leaving early aborts it."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        rid = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._streams[rid] = stream
        if self.dead_reason is not None:  # died while we registered: nobody would answer
            with self._lock:
                self._streams.pop(rid, None)
            raise EngineDeadError(self.dead_reason)
        self._commands.put(("add", request, text))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # it never entered the engine, or the engine is gone
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    async def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        deadline: float | None = None,
        add_special_tokens: bool = True,
        is_probe: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        request, text = self.prepare(
            prompt, sampling, request_id, priority, deadline, add_special_tokens, is_probe
        )
        async for out in self.stream(request, text):
            yield out

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    # ----- the loop thread -----
    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(rid)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload, text = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                assert isinstance(payload, Request)
                try:
                    self.engine.add_request(payload, text)
                except Exception as exc:
                    self._deliver(payload.request_id, exc)
            else:
                assert isinstance(payload, str)
                self.engine.abort_request(payload)

    def _loop(self) -> None:
        if self.niceness:
            lower_thread_priority(self.niceness)
        try:
            while not self._stop.is_set():
                self._last_turn = time.monotonic()
                self._drain_commands()
                for out in self.engine.take_finished_outputs():
                    self._deliver(out.request_id, out)
                if not self.engine.has_unfinished:
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # the loop itself broke: nobody may wait forever
            log.exception("engine loop died")
            self.dead_reason = f"engine loop died: {exc!r}"
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, EngineDeadError(self.dead_reason))


def lower_thread_priority(niceness: int) -> None:
    """Make the calling thread (and the compute threads it will spawn) yield the CPU sooner.

    On a machine with few cores the step loop's compute threads keep every core busy; an HTTP
    loop that wakes up to answer a probe or refuse a request then waits for a time slice. A
    higher nice value for the engine's threads lets the scheduler preempt them at once, at the
    cost of throughput only while the HTTP side actually has work. Linux applies nice per
    thread and threads inherit it, so this must run before the first parallel region.
    """
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
    except (AttributeError, OSError) as exc:  # not Linux, or not permitted: run as we are
        log.warning("could not lower the engine thread's priority: %s", exc)
