"""The engine's driver: commands in, steps while there is work, outputs out.

One thread runs ``StepLoop.run`` and owns the ``LLMEngine``; every other thread reaches it only
through ``add`` and ``abort``, which queue commands, so scheduler state is never shared. Where
the outputs go is the sink's business: asyncio streams in the same process (``AsyncEngine``) or
a pipe to the HTTP process (``core_process``). ``run`` raises when the loop itself breaks, so
whoever started it can tell every waiter that the engine is gone.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from poise.engine.outputs import EngineStats, RequestOutput
from poise.engine.request import Request

if TYPE_CHECKING:
    from poise.engine.engine import LLMEngine

log = logging.getLogger("poise.engine")


class OutputSink(Protocol):
    def deliver(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """Outputs of one turn, and the engine's state right after it."""

    def refuse(self, request_id: str, error: Exception) -> None:
        """The engine would not take this request (it reached the loop but cannot run)."""


class StepLoop:
    def __init__(
        self,
        engine: LLMEngine,
        sink: OutputSink,
        idle_wait_s: float = 0.05,
        on_turn: Callable[[float], None] | None = None,
    ) -> None:
        self.engine = engine
        self.sink = sink
        self.idle_wait_s = idle_wait_s
        self.on_turn = on_turn
        self._commands: queue.SimpleQueue[tuple[Request | str, str | None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last_turn = time.monotonic()  # every loop turn, idle or not; for a watchdog

    def add(self, request: Request, text: str | None) -> None:
        self._commands.put((request, text))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._commands.put((request_id, None))
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _drain_commands(self) -> bool:
        took = False
        while True:
            try:
                payload, text = self._commands.get_nowait()
            except queue.Empty:
                return took
            took = True
            if isinstance(payload, Request):
                try:
                    self.engine.add_request(payload, text)
                except Exception as exc:
                    self.sink.refuse(payload.request_id, exc)
            else:
                self.engine.abort_request(payload)

    def run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            now = time.monotonic()
            self.last_turn = now
            if self.on_turn is not None:
                self.on_turn(now)
            took = self._drain_commands()
            finished = engine.take_finished_outputs()
            if not engine.has_unfinished:
                if took or finished:
                    self.sink.deliver(finished, engine.stats())
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            outputs = engine.step()
            self.sink.deliver(finished + outputs, engine.stats())


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
        if os.environ.get("POISE_SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # not Linux, or not permitted: run as we are
        log.warning("could not lower the engine thread's priority: %s", exc)
