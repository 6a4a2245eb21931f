"""The engine core's side of ``ProcessEngine``: the step loop in a process of its own.

Why a process: in one interpreter the step loop's Python (scheduling, sampling, detokenizing)
and the HTTP loop take turns on the GIL, so a refusal that costs a millisecond waits for the
step's next switch interval, and on a small machine the compute threads take the cores too.
vLLM runs its engine core in its own process for the same reason. Here the HTTP process keeps
the tokenizer and validation; this process keeps the model, the KV cache and the scheduler.

The wire is two one-way pipes. Commands in: ``("add", Request, text)``, ``("abort", id)``,
``("faults", settings)``, ``("stop",)``; a reader thread moves them onto the step loop's queue
at once, so the sender never blocks behind a long step. Messages out: ``("ready", limits)`` or
``("failed", why)`` once, then ``("out", deltas, stats)`` per turn, ``("refused", id, why,
param)``, ``("faults", state)`` and, if the loop breaks, ``("dead", why)``. Only what is new
crosses the pipe (``OutputDelta``): the HTTP side rebuilds whole outputs from the deltas.
The loop stamps a shared double with every turn's start, which a watchdog reads without a
message; a loop that hangs, or a process that is stopped, simply stops stamping.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from poise.engine.config import EngineConfig
from poise.engine.outputs import EngineStats, RequestOutput
from poise.engine.step_loop import StepLoop, lower_thread_priority

log = logging.getLogger("poise.engine")


class OutputDelta(NamedTuple):
    """What one turn added to a request's output."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[dict[int, float]] | None  # entries new since the last delta; None: not asked
    num_cached_tokens: int
    error: str | None
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


class PipeSink:
    """Turns the step loop's outputs into deltas on the pipe."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        self.send = send
        self._sent_logprobs: dict[str, int] = {}

    def deliver(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        deltas = []
        for out in outputs:
            c = out.outputs[0]
            rid = out.request_id
            new_logprobs = None
            if c.logprobs is not None:
                sent = self._sent_logprobs.get(rid, 0)
                new_logprobs = c.logprobs[sent:]
                self._sent_logprobs[rid] = len(c.logprobs)
            if out.finished:
                self._sent_logprobs.pop(rid, None)
            deltas.append(
                OutputDelta(
                    rid,
                    c.delta_token_ids,
                    c.delta_text,
                    c.finish_reason,
                    c.stop_reason,
                    new_logprobs,
                    out.num_cached_tokens,
                    out.error,
                    out.first_scheduled_time,
                    out.first_token_time,
                    out.finished_time,
                )
            )
        self.send(("out", deltas, stats))

    def refuse(self, request_id: str, error: Exception) -> None:
        self.send(("refused", request_id, str(error), getattr(error, "param", None)))


def _read_commands(commands: Connection, loop: StepLoop, send: Callable[..., None]) -> None:
    faults = loop.engine.faults
    try:
        while True:
            msg = commands.recv()
            kind = msg[0]
            if kind == "add":
                loop.add(msg[1], msg[2])
            elif kind == "abort":
                loop.abort(msg[1])
            elif kind == "faults":
                if faults is not None:
                    faults.configure(**msg[1])
                send(("faults", None if faults is None else faults.snapshot()))
            elif kind == "stop":
                loop.stop()
                return
    except (EOFError, OSError):
        # The HTTP process is gone (killed): nobody will read what we compute. Out at once,
        # without the interpreter's teardown, which spent a second of a core freeing the
        # engine while the replicas that took over this one's work needed the CPU.
        log.warning("the HTTP process is gone; the engine core stops")
        os._exit(1)


def run_core(
    commands: Connection,
    outputs: Connection,
    progress: Any,  # a shared ctypes double
    model_dir: str,
    config: EngineConfig,
    niceness: int,
    fault_injection: bool,
    log_level: str,
    idle_wait_s: float = 0.05,
) -> None:
    """The engine core process's main."""
    # The HTTP process owns shutdown (drain on SIGTERM, Ctrl-C): a signal sent to its whole
    # process group must not kill the engine under requests still draining. A process group of
    # its own keeps group signals out; a signal sent to this pid still ends it, as it should.
    # Not a session of its own: with autogroup scheduling (most desktop and many VM kernels) a
    # new session is a new CPU group weighted like the HTTP process's whole session, and the
    # engine's low priority below would then count only inside that group.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if niceness:
        lower_thread_priority(niceness)
    send_lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock:
            outputs.send(msg)

    from poise.engine.engine import LLMEngine  # torch: only in this process
    from poise.engine.faults import FaultInjector

    try:
        engine = LLMEngine(model_dir, config)
    except Exception as exc:
        send(("failed", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    if fault_injection:
        engine.faults = FaultInjector()

    def stamp(now: float) -> None:
        progress.value = now

    loop = StepLoop(engine, PipeSink(send), idle_wait_s, on_turn=stamp)
    threading.Thread(
        target=_read_commands, args=(commands, loop, send), name="poise-core-reader", daemon=True
    ).start()
    send(("ready", engine.limits))
    try:
        loop.run()
    except BrokenPipeError:
        # The HTTP process is gone (killed): nobody is left to serve or to tell. Not a crash
        # of this loop, so no traceback; the exit status still says it did not stop cleanly.
        log.warning("the HTTP process is gone; the engine core stops")
        sys.exit(1)
    except BaseException as exc:
        log.exception("engine loop died")
        with contextlib.suppress(OSError):
            send(("dead", f"engine loop died: {exc!r}"))
        sys.exit(1)
