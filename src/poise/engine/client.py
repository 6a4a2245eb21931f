"""The engine as an asyncio front end sees it: validation here, one output stream per request.

``EngineClient`` is what a server holds, whatever runs the step loop. Validation and
tokenization run in the caller's thread (``RequestFactory`` touches no engine state), so bad
input fails at once. A consumer that stops iterating (client gone, task cancelled) aborts its
request, which frees its blocks at the next step. ``last_progress`` lets a watchdog tell a
working loop from a stuck one, and ``stats`` is the engine's state after its latest step.

Two kinds run the loop: ``AsyncEngine`` in a thread of this process, for tests and embedding;
``ProcessEngine`` in a process of its own, which is what the server uses so that the step loop
never competes with the HTTP loop for the interpreter. This module imports no torch.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from poise.engine.errors import EngineDeadError
from poise.engine.generation_config import SamplingDefaults
from poise.engine.intake import RequestFactory, RequestOptions
from poise.engine.outputs import EngineStats, RequestOutput
from poise.engine.request import Request
from poise.engine.tokenizer import Tokenizer


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class EngineClient(ABC):
    def __init__(self, intake: RequestFactory) -> None:
        self.intake = intake
        self.dead_reason: str | None = None
        self.stats = EngineStats(
            num_free_blocks=intake.limits.num_kv_blocks, num_blocks=intake.limits.num_kv_blocks
        )
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()

    # ----- what subclasses provide -----
    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    @property
    @abstractmethod
    def is_alive(self) -> bool: ...

    @property
    @abstractmethod
    def last_progress(self) -> float:
        """Monotonic time the loop last began a turn (a step, or an idle wait)."""

    @abstractmethod
    def _submit(self, request: Request, text: str | None) -> None: ...

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def configure_faults(self, **settings: Any) -> dict[str, Any]:
        """Set fault injection (``FaultInjector.configure``'s arguments); returns its state."""

    # ----- shared -----
    @property
    def tokenizer(self) -> Tokenizer:
        return self.intake.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.intake.limits.max_model_len

    @property
    def deterministic(self) -> bool:
        """The deterministic mode is on."""
        return self.intake.limits.deterministic

    @property
    def numerics(self) -> str:
        """In the deterministic mode, what fixes its answers' bits (``LLMEngine._numerics``)."""
        return self.intake.limits.numerics

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The model's generation config defaults for request fields left unset."""
        return self.intake.limits.sampling_defaults

    @property
    def has_work(self) -> bool:
        return bool(self._streams)

    def prepare(
        self, prompt: str | list[int], options: RequestOptions
    ) -> tuple[Request, str | None]:
        """Validate and tokenize in the caller's thread; raises on bad input, submits nothing."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        return self.intake.prepare(prompt, options)

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
        self._submit(request, text)
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
        self, prompt: str | list[int], options: RequestOptions
    ) -> AsyncIterator[RequestOutput]:
        """``prepare`` then ``stream``: the request's outputs until it finishes."""
        request, text = self.prepare(prompt, options)
        async for out in self.stream(request, text):
            yield out

    def _deliver(self, rid: str, item: RequestOutput | BaseException, threadsafe: bool) -> None:
        with self._lock:
            stream = self._streams.get(rid)
        if stream is None:
            return
        if threadsafe:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        else:
            stream.queue.put_nowait(item)

    def _fail_all(self, reason: str, threadsafe: bool) -> None:
        """The engine is gone: nobody may wait forever."""
        self.dead_reason = reason
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._deliver(rid, EngineDeadError(reason), threadsafe)
