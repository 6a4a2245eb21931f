"""The engine's step loop in a thread of this process, behind the ``EngineClient`` interface.

For tests, notebooks and embedding; the server runs the loop in a process of its own
(``process_engine``) so that it never competes with the HTTP loop for the interpreter.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from poise.engine.client import EngineClient
from poise.engine.engine import LLMEngine
from poise.engine.faults import FaultInjector
from poise.engine.outputs import EngineStats, RequestOutput
from poise.engine.request import Request
from poise.engine.step_loop import StepLoop, lower_thread_priority

log = logging.getLogger("poise.engine")


class AsyncEngine(EngineClient):
    """The step loop in a thread of this process."""

    def __init__(
        self,
        engine: LLMEngine,
        idle_wait_s: float = 0.05,
        niceness: int = 0,
        fault_injection: bool = False,
    ) -> None:
        super().__init__(engine.intake)
        self.engine = engine
        self.niceness = niceness
        if fault_injection:
            engine.faults = FaultInjector()
        self._loop = StepLoop(engine, self, idle_wait_s)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="poise-engine", daemon=True)
        self._thread.start()

    async def aclose(self) -> None:
        self._loop.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    @property
    def last_progress(self) -> float:
        return self._loop.last_turn

    def _submit(self, request: Request, text: str | None) -> None:
        self._loop.add(request, text)

    def abort(self, request_id: str) -> None:
        self._loop.abort(request_id)

    async def configure_faults(self, **settings: Any) -> dict[str, Any]:
        faults = self.engine.faults
        if faults is None:
            raise RuntimeError("fault injection is not enabled for this engine")
        faults.configure(**settings)
        return faults.snapshot()

    # ----- OutputSink, called on the loop thread -----
    def deliver(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self.stats = stats
        for out in outputs:
            self._deliver(out.request_id, out, threadsafe=True)

    def refuse(self, request_id: str, error: Exception) -> None:
        self._deliver(request_id, error, threadsafe=True)

    def _run(self) -> None:
        if self.niceness:
            lower_thread_priority(self.niceness)
        try:
            self._loop.run()
        except BaseException as exc:
            log.exception("engine loop died")
            self._fail_all(f"engine loop died: {exc!r}", threadsafe=True)
