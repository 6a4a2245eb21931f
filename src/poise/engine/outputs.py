"""What the engine hands back for a request: vLLM's shape, so users find familiar names."""

from __future__ import annotations

from dataclasses import dataclass, field

from poise.engine.forecast import IDLE_FORECAST, SlotForecast


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # everything generated so far (stop strings applied)
    token_ids: list[int]
    finish_reason: str | None  # stop, length, abort, timeout, error; None while running
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    delta_text: str = ""  # text released since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why it ended, for timeout and error
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # left the waiting queue (monotonic, as all)
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state as a front end shows it; taken between steps, never mutated."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # share of the pool held by live requests
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    step_errors: int = 0
    forecast: SlotForecast = IDLE_FORECAST
    max_running: int = 0  # the running set's cap now (max_num_seqs, or less under a budget)
    # The step-time budget's fit (seconds per step, per decode, per prompt token); None: no
    # budget, or not fitted yet.
    step_time_fit: tuple[float, float, float] | None = None
