"""The engine core's side of structured output: a grammar matcher per constrained request.

A matcher is built in a worker thread when its request is added, from a template per grammar
(deep copies are microseconds; the first build of a grammar takes what the front end's
``grammar_check`` allowed it, at most about a second, and a step that samples the request
before its build is done waits for it). It first consumes the tokens its request already has,
so a request resumed from another replica's tokens, or computed again after preemption, goes
on from the same parser state. Each step the masks of the batch's constrained rows are
computed by llguidance's parallel executor in the same worker thread while the model's forward
pass runs, and applied to the logits on their own device before sampling; after sampling each
matcher consumes its token.

A matcher that fails (its grammar exceeds llguidance's limits, or it was fed a token it does not
allow) fails its request with the reason, never the step: the other rows sample as usual.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from poise.engine.grammar_check import short_error as _short
from poise.engine.structured import GuidedDecoding

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer

_TEMPLATES = 64
# Byte value -> its 8 bits, set where the token is NOT allowed: llguidance's masks are words of
# 32 bits, little-endian, bit j of word w for token 32w + j; read as bytes and looked up here
# they unpack a batch's masks in one gather on a GPU.
_BANNED_BITS = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1) == 0


@dataclass(slots=True)
class StepMasks:
    """The step's constrained rows (indices into the sampled rows) and, for each, the tokens
    its grammar bans (a bool row of the vocabulary); failed matchers by request id."""

    rows: list[int] = field(default_factory=list)
    bitmask: torch.Tensor | None = None  # (len(rows), words) int32, llguidance's: 1 = allowed
    failed: dict[str, str] = field(default_factory=dict)


@lru_cache(maxsize=8)
def _banned_bits_on(device: torch.device) -> torch.Tensor:
    return _BANNED_BITS.to(device)


def _banned(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """llguidance's allowed-bits words → a bool per token, True where banned, on ``device``."""
    rows = bitmask.shape[0]
    if device.type == "cpu":
        # numpy unpacks bits in C: ~0.2 ms for 64 rows of a 32k vocabulary, where a lookup
        # table gather took ~3.5 ms; inverted first, so its 1s are the banned tokens.
        bits = np.unpackbits(np.invert(bitmask.numpy().view(np.uint8)), axis=1, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool).view(rows, -1)
    words = bitmask.to(device, non_blocking=True).view(torch.uint8).long()
    return _banned_bits_on(device)[words].view(rows, -1)


def apply_grammar(logits: torch.Tensor, masks: StepMasks) -> torch.Tensor:
    """The logits with each constrained row's banned tokens at -inf, on the logits' device (a
    GPU unpacks a batch's masks in microseconds: bits are sent, not a bool per token)."""
    if masks.bitmask is None:
        return logits
    device = logits.device
    banned = _banned(masks.bitmask, device)
    vocab = logits.shape[-1]
    if banned.shape[1] >= vocab:
        banned = banned[:, :vocab]
    else:  # logits past the grammar's vocabulary: no token of the tokenizer, so banned
        banned = torch.nn.functional.pad(banned, (0, vocab - banned.shape[1]), value=True)
    # In inference mode: the forward pass's logits are inference tensors, filled in place.
    with torch.inference_mode():
        if len(masks.rows) == logits.shape[0]:
            return logits.masked_fill_(banned, float("-inf"))
        rows = torch.tensor(masks.rows, dtype=torch.long, device=device)
        part = logits.index_select(0, rows).masked_fill_(banned, float("-inf"))
        return logits.index_copy_(0, rows, part)


class GuidedMatchers:
    def __init__(
        self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: frozenset[int]
    ):
        self._tokenizer_json = tokenizer_json  # called on the first constrained request
        self.vocab_size = vocab_size
        self._eos = sorted(t for t in eos_token_ids if t < vocab_size)
        # One worker: builds and mask computations run in submission order, so a request's
        # matcher is always built before the first mask that needs it.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poise-grammar")
        self._tokenizer: LLTokenizer | None = None
        self._executor: LLExecutor | None = None
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()
        self._matchers: dict[str, Future[LLMatcher | str]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def start(self, request_id: str, guided: GuidedDecoding, produced: list[int]) -> None:
        self._matchers[request_id] = self._pool.submit(self._built, guided.grammar, list(produced))

    def _built(self, grammar: str, produced: list[int]) -> LLMatcher | str:
        """The matcher, or why it could not be built: its request fails, not the step."""
        try:
            return self._build(grammar, produced)
        except BaseException as exc:  # a Rust panic is a BaseException
            return f"structured output failed: {_short(f'{type(exc).__name__}: {exc}')}"

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def _build(self, grammar: str, produced: list[int]) -> LLMatcher:
        from llguidance import LLExecutor, LLMatcher, LLTokenizer

        if self._tokenizer is None:
            # Built on the first constrained request: a replica that never gets one pays nothing.
            self._tokenizer = LLTokenizer(
                self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self._eos or None
            )
            self._executor = LLExecutor()
        template = self._templates.get(grammar)
        if template is None:
            template = LLMatcher(self._tokenizer, grammar, log_level=0)
            self._templates[grammar] = template
            if len(self._templates) > _TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        matcher = template.deep_copy()
        if produced:
            matcher.consume_tokens(produced)  # a refused token leaves it failed: reported
        return matcher

    def begin_masks(self, rows: list[tuple[int, str]]) -> Future[StepMasks] | None:
        """Masks for (row index, request id) pairs, computed in the worker; None if none is
        constrained. Call ``consume`` only after the future is done."""
        wanted = [(i, rid) for i, rid in rows if rid in self._matchers]
        if not wanted:
            return None
        return self._pool.submit(self._fill, [(i, self._matchers[rid], rid) for i, rid in wanted])

    def _fill(self, rows: list[tuple[int, Future[LLMatcher | str], str]]) -> StepMasks:
        masks = StepMasks()
        live: list[tuple[LLMatcher, int]] = []
        order: list[int] = []
        for i, future, rid in rows:
            matcher = future.result()  # built earlier by this same worker
            if isinstance(matcher, str):
                masks.failed[rid] = matcher
                continue
            if matcher.is_error():
                masks.failed[rid] = f"structured output failed: {_short(matcher.get_error())}"
                continue
            live.append((matcher, len(order)))
            order.append(i)
        if not live:
            return masks
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(order), words), -1, dtype=torch.int32)
        assert self._executor is not None
        # llguidance.torch's wrapper of this call imports torch.compile (dynamo) on import.
        self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), words * 4, len(order))
        masks.bitmask, masks.rows = bitmask, order
        return masks

    def consume(self, request_id: str, token_id: int) -> str | None:
        """Feed the sampled token: None to go on, ``"ended"`` when the grammar is complete, or
        why the matcher failed."""
        future = self._matchers.get(request_id)
        if future is None:
            return None
        matcher = future.result()
        if isinstance(matcher, str):
            return matcher
        if matcher.is_error() or not matcher.consume_token(token_id):
            return f"structured output failed: {_short(matcher.get_error())}"
        return "ended" if matcher.is_stopped() else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
