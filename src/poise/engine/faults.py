"""Fault injection for tests and chaos runs: slow steps, failing steps, a stalled loop, a KV
pool that shrinks.

Off unless a front end turns it on (``poise serve --enable-fault-injection``). The engine asks
the injector at two points of every step: ``stall`` before scheduling (the loop makes no
progress, as a hung device would) and ``before_execute`` inside the step's error handling (a
raise there fails exactly the requests of that step, as a real kernel error would).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


class InjectedFaultError(RuntimeError):
    """Raised by an injected step failure; names itself so nobody mistakes it for a bug."""


@dataclass(slots=True)
class FaultInjector:
    step_delay_s: float = 0.0  # added to every step that computes something
    fail_steps: int = 0  # the next this many computing steps raise
    stall_until: float = 0.0  # monotonic time until which the loop does not step
    kill_loop: bool = False  # the step loop itself dies at its next turn
    kv_limit_blocks: int = 0  # at most this many KV blocks held (0: the whole pool)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def configure(
        self,
        step_delay_s: float | None = None,
        fail_steps: int | None = None,
        stall_s: float | None = None,
        kill_loop: bool | None = None,
        kv_limit_blocks: int | None = None,
    ) -> None:
        with self._lock:
            if kv_limit_blocks is not None:
                self.kv_limit_blocks = max(0, kv_limit_blocks)
            if kill_loop is not None:
                self.kill_loop = kill_loop
            if step_delay_s is not None:
                self.step_delay_s = max(0.0, step_delay_s)
            if fail_steps is not None:
                self.fail_steps = max(0, fail_steps)
            if stall_s is not None:
                self.stall_until = time.monotonic() + max(0.0, stall_s)

    def clear(self) -> None:
        self.configure(
            step_delay_s=0.0, fail_steps=0, stall_s=0.0, kill_loop=False, kv_limit_blocks=0
        )

    def snapshot(self) -> dict[str, float | bool]:
        return {
            "step_delay_s": self.step_delay_s,
            "fail_steps": self.fail_steps,
            "stall_remaining_s": max(0.0, self.stall_until - time.monotonic()),
            "kill_loop": self.kill_loop,
            "kv_limit_blocks": self.kv_limit_blocks,
        }

    def stall(self) -> None:
        if self.kill_loop:
            raise InjectedFaultError("injected engine loop death")
        while time.monotonic() < self.stall_until:
            time.sleep(min(0.05, max(0.0, self.stall_until - time.monotonic())))

    def before_execute(self) -> None:
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        with self._lock:
            if self.fail_steps <= 0:
                return
            self.fail_steps -= 1
        raise InjectedFaultError("injected step failure")
