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
class KVPicture:
    """The pool beyond its usage: what is held and not filled, and what the queue will want.

    poise preempts by recompute, so a waiting or preempted request holds no block; its full
    blocks stay in the prefix cache (free, evictable) until someone needs the room. What it
    will take again to start is what admission and an operator need to know."""

    allocated_slots: int = 0  # token slots in the blocks running requests hold
    unused_slots: int = 0  # ... that hold no token yet (each request's last block, mostly)
    waiting_blocks: int = 0  # blocks the never-started waiting requests need to start
    preempted_blocks: int = 0  # blocks the preempted ones need to be computed again

    @property
    def fragmentation(self) -> float:
        """Share of allocated slots holding no token."""
        return self.unused_slots / self.allocated_slots if self.allocated_slots else 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state as a front end shows it; taken between steps, never mutated."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # share of the pool held by live requests
    num_free_blocks: int = 0
    num_blocks: int = 0  # the pool's blocks (fewer while a fault limits it)
    num_preemptions: int = 0
    num_room_waits: int = 0  # requests held back at least once for lack of KV room
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    step_errors: int = 0
    forecast: SlotForecast = IDLE_FORECAST
    max_running: int = 0  # the running set's cap now (max_num_seqs, or less under a budget)
    # The step-time budget's fit (seconds per step, per decode, per prompt token); None: no
    # budget, or not fitted yet.
    step_time_fit: tuple[float, float, float] | None = None
    kv: KVPicture = field(default_factory=KVPicture)
    # Running and waiting user requests by priority (health probes left out).
    running_by_priority: dict[int, int] = field(default_factory=dict)
    waiting_by_priority: dict[int, int] = field(default_factory=dict)
