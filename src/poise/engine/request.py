"""A request inside the engine: its sampling parameters, its state machine and how it ends.

The lifecycle is one ordered enum. Every status at or after ``FINISHED_STOPPED`` is final and
carries exactly one finish reason; ``Request.finish`` is the only way to get there and it refuses
a second finish, so a request ends exactly once. Freeing its KV blocks is the scheduler's job and
happens in the one place that calls ``finish`` (``Scheduler._finish``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from poise.engine.errors import InvalidRequestError
from poise.engine.structured import GuidedDecoding


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is final.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_TIMEOUT = 13
    FINISHED_ERROR = 14

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
    RequestStatus.FINISHED_ERROR: "error",
}

_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING}),
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED}),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING}),
}


class IllegalTransitionError(RuntimeError):
    """A bug: the engine tried to move a request along an edge the state machine lacks."""


GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop; the same names as vLLM's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (0: off)
    max_tokens: int | None = 16  # None: up to the model's context length
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives to return with each token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Hugging Face's: every token of the prompt or output so far has its logit divided by this
    # (multiplied, when negative). 1.0: off.
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # OpenAI's: added to a token's logit before sampling (in [-100, 100]; -100 bans it).
    logit_bias: dict[int, float] | None = None
    guided: GuidedDecoding | None = None  # what the output must match (structured output)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param)

        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not (-2.0 <= value <= 2.0):
                raise bad(name, f"must be in [-2, 2], got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(
                "repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):  # type: ignore[union-attr]
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            raise bad("stop_token_ids", "must be non-negative integers")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise bad("logit_bias", f"keys must be token ids, got {token!r}")
            if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"values must be in [-100, 100], got {bias}")
        if self.guided is not None and self.min_tokens > 0:
            # Ending may be the only thing the grammar allows; min_tokens would forbid it.
            raise bad("min_tokens", "cannot be combined with structured output")
        if self.guided is not None and self.ignore_eos:
            # A complete answer ends the request: there is nothing left to generate past it.
            raise bad("ignore_eos", "cannot be combined with structured output")
        if self.guided is not None and self.logit_bias:
            # It may ban every token the grammar allows, which leaves nothing to sample.
            raise bad("logit_bias", "cannot be combined with structured output")

    @property
    def greedy(self) -> bool:
        # As vLLM: a temperature this small is argmax in all but name, and dividing
        # logits by a denormal such as 5e-324 would overflow them to inf.
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True, slots=True)
class StreamPace:
    """A request streaming its answer, as a step's time budget weighs a long step against it."""

    streamed: int  # tokens it has streamed here, its first included
    first_token_at: float  # when its first token here came, on the scheduler's clock
    expected_more: int  # tokens it is known to stream after the one this step gives it


@dataclass(slots=True)
class Request:
    """One sequence being generated. ``all_token_ids`` is prompt followed by output."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    max_tokens: int  # resolved: sampling.max_tokens or what the context leaves
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first, as in vLLM
    deadline: float | None = None  # on the engine's monotonic clock; None = no deadline
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # How many leading tokens of all_token_ids have their K/V in the cache.
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at its (last) admission
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    # Roots the hash chain: requests with different salts never share cached blocks.
    cache_salt: int | None = None
    error: str | None = None
    first_scheduled_time: float | None = None
    # When this engine gave it its first token (the scheduler's clock), and how many outputs it
    # had before that (a resumed stream's carried ones).
    first_token_time: float | None = None
    outputs_before_first: int = 0
    is_probe: bool = False  # a health check's one-token request: skips the running cap
    resume_text_chars: int = 0  # resumed: characters of the first outputs' text already sent
    # When the scheduler first let others start past it for lack of KV room (None: not now).
    passed_over_since: float | None = None
    waited_for_room: bool = False  # it was held at least once because the pool had no room

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens not yet in the KV cache: 1 while it decodes, more while its prompt is."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def runs_to_max_tokens(self) -> bool:
        """Nothing but its length ends it (``ignore_eos``, no stop string or token, no
        grammar): it will produce exactly ``max_tokens``, however short others' answers are."""
        sp = self.sampling
        return sp.ignore_eos and not sp.stop and not sp.stop_token_ids and sp.guided is None

    @property
    def sort_key(self) -> tuple[int, float]:
        """Who goes first: lower priority value, then earlier arrival."""
        return (self.priority, self.arrival_time)

    def append_output_token(self, token_id: int) -> None:
        """The one mutator for generated tokens."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def transition(self, to: RequestStatus) -> None:
        if to.is_finished:
            raise IllegalTransitionError("use finish() to end a request")
        if to not in _ALLOWED.get(self.status, frozenset()):
            raise IllegalTransitionError(f"{self.request_id}: {self.status.name} -> {to.name}")
        self.status = to

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        if not status.is_finished:
            raise IllegalTransitionError(f"{status.name} is not a finish status")
        if self.is_finished:
            raise IllegalTransitionError(
                f"{self.request_id} already finished as {self.status.name}"
            )
        self.status = status
        self.error = error

    def check_stop_token(self) -> RequestStatus | None:
        """After a token was appended: does a token or length rule end this request?"""
        if not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        n_out = len(self.output_token_ids)
        if n_out >= self.sampling.min_tokens:
            if not self.sampling.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in self.sampling.stop_token_ids:  # type: ignore[operator]
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
