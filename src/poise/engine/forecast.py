"""When the next running slots free up: the engine's own forecast for admission control.

A replica whose running set is capped (``max_num_seqs``) starts a waiting request only when a
running one finishes. An average start rate hides how lumpy that is: requests that started
together and ask for the same number of tokens also finish together, so for most of a cycle
nothing starts at all and a request arriving just after a wave waits a whole output's length.
The engine knows better than any average: for each running request it knows how many tokens it
may still produce. This module turns that into "the k-th free slot appears in about s seconds",
published after every step as an immutable snapshot that the HTTP thread reads without locks.

A request's remaining length is its ``max_tokens`` left, tempered by the output lengths seen so
far (most requests end at EOS long before a context-sized ``max_tokens``): the estimate is the
smaller of the two, and at least one step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotForecast:
    free_slots: int
    release_steps: tuple[int, ...]  # per running request, steps until it ends; ascending
    step_s: float  # recent wall time of one busy step
    cycle_steps: int  # a typical request's whole output, in steps
    # Slots a growing cap opens (a step-time budget whose steps still leave room: its cap has
    # not been reached, only not yet needed): one per two steps, since a request admitted in
    # a step is a prompt chunk there and counts towards the cap once it decodes.
    growth_slots: int = 0

    def wait_s(self, position: int) -> float:
        """Seconds until the ``position``-th request in line (1 = next) gets a running slot."""
        if position <= self.free_slots:
            return 0.0
        j = position - self.free_slots - 1
        if not self.release_steps:
            return 0.0
        # Past the running set, a released slot is taken again by one ahead: a cycle later.
        cycles, i = divmod(j, len(self.release_steps))
        steps = self.release_steps[i] + cycles * self.cycle_steps
        if j < self.growth_slots:
            steps = min(steps, 2 * (j + 1))
        return steps * self.step_s


IDLE_FORECAST = SlotForecast(free_slots=1 << 30, release_steps=(), step_s=0.0, cycle_steps=0)


class SlotForecaster:
    """Keeps the step time and typical output length; makes a ``SlotForecast`` on demand."""

    def __init__(self, max_num_seqs: int, alpha: float = 0.1) -> None:
        self.max_num_seqs = max_num_seqs
        self.alpha = alpha
        self.step_s: float | None = None
        self.mean_output_tokens: float | None = None

    def observe_step(self, seconds: float) -> None:
        a = self.alpha
        self.step_s = seconds if self.step_s is None else (1 - a) * self.step_s + a * seconds

    def observe_finished(self, output_tokens: int) -> None:
        a = self.alpha
        mean = self.mean_output_tokens
        self.mean_output_tokens = (
            float(output_tokens) if mean is None else (1 - a) * mean + a * output_tokens
        )

    def forecast(
        self,
        running: Iterable[tuple[int, int]],
        max_running: int | None = None,
        cap_grows: bool = False,
    ) -> SlotForecast:
        """``running``: (tokens produced, max_tokens) of each request holding a slot;
        ``max_running``: the running set's cap now, when lower than ``max_num_seqs``;
        ``cap_grows``: whether that cap is still rising (then a request past it waits two steps
        per request ahead, not for one to finish)."""
        typical = self.mean_output_tokens
        steps = []
        for produced, max_tokens in running:
            left = max_tokens - produced
            if typical is not None:
                left = min(left, round(typical) - produced)
            steps.append(max(1, left))
        steps.sort()
        cap = min(self.max_num_seqs, max_running or self.max_num_seqs)
        return SlotForecast(
            free_slots=max(0, cap - len(steps)),
            release_steps=tuple(steps),
            step_s=self.step_s or 0.0,
            cycle_steps=round(typical) if typical is not None else (steps[-1] if steps else 0),
            growth_slots=self.max_num_seqs - max(cap, len(steps)) if cap_grows else 0,
        )
