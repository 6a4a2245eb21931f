"""Turning a prompt and its ``RequestOptions`` into a validated engine ``Request``.

It needs only the tokenizer and a few numbers about the loaded model and its KV pool
(``IntakeLimits``), never the weights, so a front end whose engine runs in another process
validates and tokenizes on its own side and refuses bad input without a round trip.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from poise.engine.errors import InvalidRequestError, RequestTooLargeError
from poise.engine.generation_config import SamplingDefaults
from poise.engine.grammar_check import GrammarChecker
from poise.engine.request import Request, SamplingParams
from poise.engine.structured import GuidedDecoding
from poise.engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class IntakeLimits:
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_kv_blocks: int
    block_size: int
    # From the model's generation config: what front ends fill unset request fields with.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # The deterministic mode is on (what /version and /health tell a gateway), and what fixes
    # its arithmetic: engines with the same fingerprint give a request the same bits.
    deterministic: bool = False
    numerics: str = ""


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a generation stands: the tokens it produced and how much of their text was sent."""

    token_ids: list[int]
    text_chars: int = 0


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Everything about one request but its prompt, as a front end asks for it; passed whole
    from the front end (``EngineClient.prepare``, ``LLMEngine.prepare_request``) to here."""

    sampling: SamplingParams
    request_id: str | None = None  # None: a fresh random id
    priority: int = 0  # lower is served first, and preempted last
    deadline: float | None = None  # on the engine's clock; reached, the request ends as timeout
    add_special_tokens: bool = True  # a text prompt gets the tokenizer's BOS and the like
    is_probe: bool = False  # a health check's one-token request: passes the queue's caps
    resume: Resume | None = None  # continue a generation another replica began (failover)


def check_fits(request: Request, num_blocks: int, block_size: int) -> None:
    """Refuse at once what can never fit the KV pool, however idle the engine is."""
    need = -(-(request.num_prompt_tokens + request.max_tokens) // block_size)
    if need > num_blocks:
        raise RequestTooLargeError(
            f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
            f"({request.max_tokens}) needs {need} KV blocks of {block_size} tokens, "
            f"but the whole pool has {num_blocks}",
            param="max_tokens",
        )


class RequestFactory:
    """Validates and tokenizes; touches no engine state, so any thread may call it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: IntakeLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.clock = clock
        self._checker: GrammarChecker | None = None
        self._checker_lock = threading.Lock()

    def grammar_checker(self) -> GrammarChecker:
        """Started on the first constrained request: a server that gets none pays nothing."""
        with self._checker_lock:
            if self._checker is None:
                lim = self.limits
                eos = sorted(t for t in lim.eos_token_ids if t < lim.vocab_size)
                self._checker = GrammarChecker(self.tokenizer.to_json(), lim.vocab_size, eos)
            return self._checker

    def check_guided(self, guided: GuidedDecoding) -> None:
        """Raises the 400 for a constraint the grammar engine cannot start (cached verdicts);
        blocks up to the checker's time limit on a grammar it has not seen."""
        problem = self.grammar_checker().check(guided.grammar)
        if problem is not None:
            raise InvalidRequestError(
                f"{guided.param} cannot be enforced: {problem}", param=guided.param
            )

    def prepare(
        self, prompt: str | list[int], options: RequestOptions
    ) -> tuple[Request, str | None]:
        """The request and its prompt's text (None for token ids); raises on bad input."""
        lim = self.limits
        sampling = options.sampling
        if sampling.guided is not None:
            self.check_guided(sampling.guided)
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=options.add_special_tokens)
            if ids and max(ids) >= lim.vocab_size:
                # A tokenizer with added tokens past the model's embeddings: the model has no
                # row for them, and feeding one would fail the whole batch's step.
                raise InvalidRequestError(
                    f"the prompt holds token {max(ids)} "
                    f"({self.tokenizer.decode([max(ids)], skip_special_tokens=False)!r}), "
                    f"which this model's vocabulary of {lim.vocab_size} does not have",
                    param="prompt",
                )
        else:
            text, ids = None, list(prompt)
            if any(not isinstance(t, int) or not 0 <= t < lim.vocab_size for t in ids):
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {lim.vocab_size})", param="prompt"
                )
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if sampling.logit_bias and max(sampling.logit_bias) >= lim.vocab_size:
            raise InvalidRequestError(
                f"logit_bias names token {max(sampling.logit_bias)}, which this model's "
                f"vocabulary of {lim.vocab_size} does not have",
                param="logit_bias",
            )
        room = lim.max_model_len - len(ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but this model's context is "
                f"{lim.max_model_len} tokens",
                param="prompt",
            )
        max_tokens = sampling.max_tokens if sampling.max_tokens is not None else room
        defaults = lim.sampling_defaults
        if sampling.max_tokens is None and defaults.max_tokens is not None:
            # The file's max_new_tokens is a default, not a demand: capped by the context, as
            # vLLM caps it; only a max_tokens the request itself asks for can be refused.
            max_tokens = min(room, defaults.max_tokens)
        elif sampling.max_tokens is None and defaults.max_length is not None:
            # transformers' max_length counts the prompt; one that long still gets a token there.
            max_tokens = min(room, max(1, defaults.max_length - len(ids)))
        if max_tokens > room:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds this "
                f"model's context of {lim.max_model_len} tokens",
                param="max_tokens",
            )
        request = Request(
            request_id=options.request_id or uuid.uuid4().hex,
            prompt_token_ids=ids,
            sampling=sampling,
            arrival_time=self.clock(),
            max_tokens=max_tokens,
            eos_token_ids=lim.eos_token_ids,
            priority=options.priority,
            deadline=options.deadline,
            is_probe=options.is_probe,
        )
        if options.resume is not None:
            self._resume(request, options.resume)
        check_fits(request, lim.num_kv_blocks, lim.block_size)
        return request, text

    def _resume(self, request: Request, resume: Resume) -> None:
        ids = resume.token_ids
        vocab = self.limits.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(
                f"resumed token ids must be integers in [0, {vocab})", param="poise_resume"
            )
        if len(ids) >= request.max_tokens:
            raise InvalidRequestError(
                f"{len(ids)} tokens to resume from leave nothing of max_tokens "
                f"({request.max_tokens}) to generate",
                param="poise_resume",
            )
        for t in ids:
            request.append_output_token(t)
        request.resume_text_chars = resume.text_chars
