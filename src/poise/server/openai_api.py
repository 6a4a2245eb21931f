"""OpenAI's completions and chat completions over a ``Replica``: a request in, a planned call out.

Everything before the engine runs happens here, synchronously in the route: the model check,
sampling parameters (with the generation config's defaults), structured output and tool plans,
the chat template, tokenizing and admission. ``answers`` turns the call's outputs into the
answer or its stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from poise.engine.errors import InvalidRequestError
from poise.engine.generation_config import SamplingDefaults
from poise.engine.intake import Resume
from poise.engine.request import SamplingParams
from poise.engine.structured import GuidedDecoding
from poise.observability.tracing import INPUT_TOKENS, RESPONSE_ID
from poise.protocol import (
    CONTINUATION_HEADER,
    STREAM_TOKENS_HEADER,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now_s,
)
from poise.server.access import RequestReport
from poise.server.answers import Call, collect, stream_events
from poise.server.replica import Prepared, Replica, Terms
from poise.server.structured_request import guided_for, logit_bias_for
from poise.server.tool_calls import plan_tools, tool_guided


def priority_from(body_priority: int | None, header: str | None) -> int:
    """The body's ``priority`` or the ``X-Priority`` header; with both, the less urgent. A
    gateway sets the header to what the client's key allows, so a body cannot raise it."""
    if header is None:
        return 0 if body_priority is None else body_priority
    try:
        value = int(header)
    except ValueError:
        raise APIError(400, "X-Priority must be an integer", param="X-Priority") from None
    if not -(2**31) < value < 2**31:
        raise APIError(400, "X-Priority is out of range", param="X-Priority")
    return value if body_priority is None else max(value, body_priority)


def _sampling(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    choice: int,
    defaults: SamplingDefaults,
    guided: GuidedDecoding | None = None,
) -> SamplingParams:
    """What the body set wins; what it left unset (None) takes the model's generation config
    defaults, then poise's own."""
    d = defaults
    try:
        return SamplingParams(
            temperature=d.pick("temperature", body.temperature, 1.0),
            top_p=d.pick("top_p", body.top_p, 1.0),
            top_k=d.pick("top_k", body.top_k, 0),
            min_p=d.pick("min_p", body.min_p, 0.0),
            repetition_penalty=d.pick("repetition_penalty", body.repetition_penalty, 1.0),
            # None here: the generation config's max_new_tokens or max_length, within the
            # context, or else up to the context (the intake decides, knowing the prompt).
            max_tokens=max_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            # n choices with one seed must still differ, and stay reproducible.
            seed=None if body.seed is None else (body.seed + choice) % (2**63),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            min_tokens=body.min_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=logit_bias_for(body),
            guided=guided,
        )
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def _terms(replica: Replica, body_priority: int | None, headers: Mapping[str, str]) -> Terms:
    priority = priority_from(body_priority, headers.get("x-priority"))
    return replica.terms_from(priority, headers, headers.get(CONTINUATION_HEADER) == "1")


def _start(
    replica: Replica,
    prompts: list[str | list[int]],
    samplings: list[SamplingParams],
    terms: Terms,
    add_special_tokens: bool,
    resume: Resume | None = None,
) -> list[Prepared]:
    replica.check_accepting()
    group = replica.prepare(prompts, samplings, terms, add_special_tokens, resume)
    # Only a resume that carries generated tokens continues anything (an empty one is a fresh
    # request under another name, and gets no pass); or the gateway's continuation of another
    # engine's stream from its text (``Terms.continues``).
    continuation = terms.continues or (resume is not None and len(resume.token_ids) > 0)
    replica.admit(group, terms, continuation=continuation)
    return group


@dataclass(slots=True)
class Planned:
    """An admitted call, not yet running. Everything before it (validation, tokenizing,
    admission) ran synchronously in the route, so a refusal costs no extra loop turns; ``run``
    is the part that waits for the engine. ``release_if_unstarted`` gives back admission places
    should ``run`` never start (the client left first)."""

    call: Call
    stream: bool
    top: int | None
    include_usage: bool
    echo: list[str]
    started: bool = False

    async def run(self) -> dict[str, Any] | AsyncIterator[bytes]:
        self.started = True
        if self.stream:
            return await stream_events(self.call, self.top, self.include_usage)
        return await collect(self.call, self.top, self.echo)

    def reported_to(self, report: RequestReport) -> None:
        """Every choice's engine timings go to the request's report (and so to its trace)."""
        report.prompt_tokens = self.call.prompt_tokens
        report.request_id = report.request_id or self.call.response_id
        if report.trace is not None:
            report.trace.span.set_attribute(INPUT_TOKENS, self.call.prompt_tokens)
            report.trace.span.set_attribute(RESPONSE_ID, self.call.response_id)
        for p in self.call.group:
            p.report = report

    def release_if_unstarted(self) -> None:
        if not self.started:
            for p in self.call.group:
                self.call.replica.admission.left(p.request.request_id)


def check_model(replica: Replica, model: str | None) -> str:
    if model is not None and model != replica.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {replica.model_name!r}",
            param="model",
            code="model_not_found",
        )
    return replica.model_name


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    raise APIError(400, "prompt must be a string, strings, token ids or lists of them", "prompt")


def _check_choices(replica: Replica, prompts: int, n: int) -> None:
    """A request's choices are admitted together, so more of them than may wait at once could
    never be: refused (400: no retry helps) before each is tokenized and set up, which for a
    body of thousands of prompts held the event loop for seconds only to answer 429."""
    most = replica.settings.max_waiting_requests
    if prompts * n > most:
        raise APIError(
            400,
            f"the request asks for {prompts * n} choices ({prompts} prompt(s), n={n}); "
            f"this server takes at most {most} in one request",
            param="prompt" if n == 1 else "n",
        )


def _resume(body: CompletionRequest | ChatCompletionRequest, choices: int) -> Resume | None:
    state = body.poise_resume
    if state is None:
        return None
    logprobs = body.logprobs if isinstance(body, CompletionRequest) else body.logprobs or None
    if not body.stream or choices != 1 or logprobs is not None:
        raise APIError(
            400,
            "poise_resume continues one streamed choice without logprobs",
            param="poise_resume",
        )
    return Resume(state.token_ids, state.text_chars)


def _call(
    replica: Replica,
    group: list[Prepared],
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
    model: str,
    headers: Mapping[str, str],
) -> Call:
    state = body.poise_resume
    call = Call(
        replica,
        group,
        body.n,
        chat,
        (state and state.id) or new_id("chatcmpl" if chat else "cmpl"),
        (state and state.created) or now_s(),
        model,
        notes=len(group) == 1 and headers.get(STREAM_TOKENS_HEADER) == "1",
    )
    if state is not None:
        call.resumed = True
        call.sent_chars = state.text_chars
    return call


def create_completion(
    replica: Replica, body: CompletionRequest, headers: Mapping[str, str]
) -> Planned:
    model = check_model(replica, body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of different from n is not supported", param="best_of")
    if body.echo and (body.stream or body.logprobs is not None):
        raise APIError(400, "echo works only without stream and logprobs", param="echo")
    prompts = _prompts(body.prompt)
    _check_choices(replica, len(prompts), body.n)
    expanded = [p for p in prompts for _ in range(body.n)]
    defaults = replica.engine.sampling_defaults
    guided = guided_for(body)
    samplings = [
        _sampling(body, body.max_tokens, body.logprobs, j, defaults, guided)
        for _ in prompts
        for j in range(body.n)
    ]
    resume = _resume(body, len(expanded))
    terms = _terms(replica, body.priority, headers)
    group = _start(replica, expanded, samplings, terms, True, resume)
    call = _call(replica, group, body, False, model, headers)
    include = bool(body.stream_options and body.stream_options.include_usage)
    tokenizer = replica.engine.tokenizer
    echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if body.echo else []
    return Planned(call, body.stream, body.logprobs, include, echo)


def create_chat_completion(
    replica: Replica, body: ChatCompletionRequest, headers: Mapping[str, str]
) -> Planned:
    model = check_model(replica, body.model)
    _check_choices(replica, 1, body.n)
    # Before the template and the grammar: its first-token objective counts from here.
    terms = _terms(replica, body.priority, headers)
    if body.add_generation_prompt and body.continue_final_message:
        raise APIError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    tokenizer = replica.engine.tokenizer
    if (
        body.chat_template is not None
        and not replica.settings.trust_request_chat_template
        and not tokenizer.chat_templates.is_own(body.chat_template)
    ):
        raise APIError(
            400,
            "chat_template may only name one of this model's templates; a template of the "
            "request's own needs the server's --trust-request-chat-template",
            param="chat_template",
        )
    messages = [m.template_dict() for m in body.messages]
    tools = None if body.tools is None else [t.model_dump(exclude_none=True) for t in body.tools]
    try:
        plan = plan_tools(
            body,
            replica.settings.tool_call_parser,
            tokenizer.chat_templates.pick(body.chat_template, tools),
        )
        prompt = tokenizer.apply_chat_template(
            messages,
            body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=tools,
            documents=body.documents,
            chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
        )
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    top = body.top_logprobs if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = (top or 0) if body.logprobs else None
    defaults = replica.engine.sampling_defaults
    try:
        forced = None if plan is None else tool_guided(plan)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    guided = guided_for(body, forced)
    samplings = [_sampling(body, max_tokens, logprobs, j, defaults, guided) for j in range(body.n)]
    resume = _resume(body, body.n)
    # The template writes the special tokens itself.
    group = _start(replica, [prompt] * body.n, samplings, terms, False, resume)
    call = _call(replica, group, body, True, model, headers)
    call.tools = plan if plan is not None and plan.mode != "none" else None
    include = bool(body.stream_options and body.stream_options.include_usage)
    return Planned(call, body.stream, top, include, _chat_echo(body, call.tools is not None))


def _chat_echo(body: ChatCompletionRequest, tool_calls: bool) -> list[str]:
    """vLLM's echo on chat: an answer that continues the last message (an assistant's) starts
    with that message's text; other roles echo nothing."""
    if not body.echo:
        return []
    if body.stream or tool_calls:
        raise APIError(400, "echo works only without stream and tool calls", param="echo")
    last = body.messages[-1]
    return [last.text() if last.role == "assistant" else ""]
