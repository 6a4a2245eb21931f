"""The HTTP process's handle on an engine core running in a process of its own.

See ``core_process`` for why and for the wire. This side keeps the tokenizer (validation and
refusals never cross the pipe), sends commands from a thread of its own (a stopped or stuck
core must not block the event loop on a full pipe), and reads the core's messages on the event
loop itself (``add_reader``), where it rebuilds each request's whole output from the deltas.
When the core process dies, for whatever reason, every waiting request is told at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poise.engine.client import EngineClient
from poise.engine.config import EngineConfig
from poise.engine.core_process import OutputDelta, run_core
from poise.engine.errors import InvalidRequestError, ModelLoadError
from poise.engine.intake import IntakeLimits, RequestFactory
from poise.engine.models.checkpoint import load_tokenizer
from poise.engine.outputs import CompletionOutput, RequestOutput
from poise.engine.request import Request

log = logging.getLogger("poise.engine")


@dataclass(slots=True)
class _Accumulated:
    request: Request
    prompt: str | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None

    def apply(self, d: OutputDelta) -> RequestOutput:
        self.token_ids.extend(d.token_ids)
        self.text += d.text
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(d.logprobs)
        finished = d.finish_reason is not None
        request = self.request
        return RequestOutput(
            request_id=request.request_id,
            prompt=self.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=self.text,
                    token_ids=list(self.token_ids),
                    finish_reason=d.finish_reason,
                    logprobs=self.logprobs,
                    stop_reason=d.stop_reason,
                    delta_text=d.text,
                    delta_token_ids=d.token_ids,
                )
            ],
            finished=finished,
            num_cached_tokens=d.num_cached_tokens,
            error=d.error,
            arrival_time=request.arrival_time,
            first_scheduled_time=d.first_scheduled_time,
            first_token_time=d.first_token_time,
            finished_time=d.finished_time,
        )


class ProcessEngine(EngineClient):
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig,
        niceness: int = 0,
        fault_injection: bool = False,
        log_level: str = "warning",
        startup_timeout_s: float = 900.0,
    ) -> None:
        ctx = mp.get_context("spawn")  # never fork a process with threads and an event loop
        core_commands, self._to_core = ctx.Pipe(duplex=False)
        self._from_core, core_outputs = ctx.Pipe(duplex=False)
        self._progress = ctx.RawValue("d", time.monotonic())
        self.process = ctx.Process(
            target=run_core,
            args=(
                core_commands,
                core_outputs,
                self._progress,
                str(model_dir),
                config,
                niceness,
                fault_injection,
                log_level,
            ),
            name="poise-engine-core",
            daemon=True,
        )
        self.process.start()
        core_commands.close()
        core_outputs.close()
        try:
            limits = self._await_ready(startup_timeout_s)
        except BaseException:
            self._kill()
            raise
        super().__init__(RequestFactory(load_tokenizer(model_dir), limits))
        self._accumulated: dict[str, _Accumulated] = {}
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._fault_replies: deque[asyncio.Future[dict[str, Any] | None]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender: threading.Thread | None = None
        self._closing = False

    def _await_ready(self, timeout_s: float) -> IntakeLimits:
        end = time.monotonic() + timeout_s
        while not self._from_core.poll(0.5):
            if not self.process.is_alive():
                break
            if time.monotonic() > end:
                raise ModelLoadError(f"the engine core did not load within {timeout_s:g}s")
        try:
            kind, payload = self._from_core.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise ModelLoadError(
                f"the engine core process exited while loading ({self._exit_description()})"
            ) from None
        if kind != "ready":
            raise ModelLoadError(str(payload))
        return payload  # type: ignore[no-any-return]

    # ----- lifecycle -----
    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._from_core.fileno(), self._on_readable)
        self._sender = threading.Thread(
            target=self._send_loop, name="poise-core-sender", daemon=True
        )
        self._sender.start()

    async def aclose(self) -> None:
        self._closing = True
        self._outbox.put(("stop",))
        self._outbox.put(None)
        await asyncio.to_thread(self.process.join, 10.0)
        self._kill()
        self._stop_reading()
        if self._sender is not None:
            await asyncio.to_thread(self._sender.join, 5.0)

    def _kill(self) -> None:
        if self.process.is_alive():
            log.warning("the engine core did not stop in time; killing it")
            self.process.kill()
            self.process.join(5.0)

    @property
    def is_alive(self) -> bool:
        return self._loop is not None and self.dead_reason is None and self.process.is_alive()

    @property
    def last_progress(self) -> float:
        return float(self._progress.value)

    # ----- commands -----
    def _submit(self, request: Request, text: str | None) -> None:
        # A resumed request's outputs count the tokens it was resumed from, as in the core.
        acc = _Accumulated(request, text, list(request.output_token_ids))
        self._accumulated[request.request_id] = acc
        self._outbox.put(("add", request, text))

    def abort(self, request_id: str) -> None:
        self._outbox.put(("abort", request_id))

    async def configure_faults(self, **settings: Any) -> dict[str, Any]:
        reply: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._fault_replies.append(reply)
        self._outbox.put(("faults", settings))
        state = await asyncio.wait_for(reply, 10.0)
        if state is None:
            raise RuntimeError("fault injection is not enabled for this engine")
        return state

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._to_core.send(msg)
            except (OSError, ValueError):
                return  # the core is gone; the reader says so

    # ----- messages from the core, on the event loop -----
    def _on_readable(self) -> None:
        try:
            while self._from_core.poll():
                self._handle(self._from_core.recv())
        except (EOFError, OSError):
            self._stop_reading()
            self.process.join(1.0)
            why = "stopped" if self._closing else f"exited ({self._exit_description()})"
            self._gone(f"the engine core process {why}")

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "out":
            _, deltas, stats = msg
            self.stats = stats
            for d in deltas:
                acc = self._accumulated.get(d.request_id)
                if acc is None:
                    continue
                out = acc.apply(d)
                if out.finished:
                    del self._accumulated[d.request_id]
                self._deliver(d.request_id, out, threadsafe=False)
        elif kind == "refused":
            _, rid, why, param = msg
            self._accumulated.pop(rid, None)
            self._deliver(rid, InvalidRequestError(why, param=param), threadsafe=False)
        elif kind == "faults":
            if self._fault_replies:
                reply = self._fault_replies.popleft()
                if not reply.done():
                    reply.set_result(msg[1])
        elif kind == "dead":
            self._gone(msg[1])

    def _gone(self, reason: str) -> None:
        if self.dead_reason is None:
            if not self._closing:
                log.error("engine core: %s", reason)
            self._fail_all(reason, threadsafe=False)
        self._accumulated.clear()
        while self._fault_replies:
            reply = self._fault_replies.popleft()
            if not reply.done():
                reply.set_exception(RuntimeError(reason))

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._from_core.closed:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._from_core.fileno())

    def _exit_description(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {-code}"
        return f"exit code {code}"
