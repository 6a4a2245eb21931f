"""OpenAI's wire format: request and response models and the error shape.

Shared by the replica server and the gateway, so both speak exactly the same dialect. Field names
and defaults follow OpenAI's API reference; the extra sampling fields vLLM users send (``top_k``,
``ignore_eos``, ``priority``, ``min_tokens``, ``stop_token_ids``) are accepted too. A field poise
accepts is honoured; any other top-level field is refused (400 naming it, in OpenAI's words), as
OpenAI refuses it, rather than ignored as vLLM does: a client that sets ``logit_bias`` or
``response_format`` must learn that it had no effect. Messages may carry fields of their own
(``refusal``, ``annotations`` of an answer sent back): the chat template reads what it knows.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# ----- errors -----

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "api_error"),
            "param": param,
            "code": code,
        }
    }


class APIError(Exception):
    """An error with its HTTP status, raised anywhere a request is handled."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


DEADLINE_HEADER = "x-request-deadline-ms"
# A request's own latency objectives, as the Kubernetes Gateway API Inference Extension's
# latency-aware scheduling names them: its first token within this many milliseconds of being
# sent, and each next token within this many. A poise replica refuses at once (429) what it
# predicts it cannot serve within them; a gateway passes on what is left of the first.
TTFT_SLO_HEADER = "x-slo-ttft-ms"
TPOT_SLO_HEADER = "x-slo-tpot-ms"
# On a gateway's answer: how many upstream attempts it took (Envoy: x-envoy-attempt-count).
ATTEMPT_COUNT_HEADER = "x-poise-attempt-count"
# Asks a poise replica to put a note before each streamed event: the event's new token ids and
# the characters of text sent so far. The gateway strips the notes and, should the stream
# break, resumes the generation on another replica from exactly there (``poise_resume``).
STREAM_TOKENS_HEADER = "x-poise-stream-tokens"
TOKEN_NOTE_PREFIX = b": poise-tokens "
# Set by the gateway (never passed on from a client) on a request that continues a stream the
# client is already receiving, from its text (another engine's broken stream): a replica admits
# it past its predicted-wait bounds, as it does a ``poise_resume``.
CONTINUATION_HEADER = "x-poise-continuation"
# On a poise replica's 429 for load: it refuses every request of this priority or worse for
# now, whatever its size (absent: the request's own size or deadline decided), but one whose
# first-token objective leaves at least ``SPARES_HEADER`` ms (a patient client's, held to its
# objective instead). A gateway holds such requests back for a moment rather than forward a
# flood only to carry its refusals back.
SHEDDING_HEADER = "x-poise-shedding-priority"
SPARES_HEADER = "x-poise-shedding-spares-ms"


def token_note(token_ids: list[int], text_chars: int) -> bytes:
    """An SSE comment line (clients ignore those) saying where a stream stands."""
    return TOKEN_NOTE_PREFIX + ",".join(map(str, token_ids)).encode() + b" %d\n" % text_chars


def parse_token_note(line: bytes) -> tuple[list[int], int]:
    """``token_note``'s inverse; raises ValueError on anything else."""
    ids, chars = line[len(TOKEN_NOTE_PREFIX) :].split(b" ")
    return [int(t) for t in ids.split(b",") if t], int(chars)


_MAX_DEADLINE_MS = 1e10


def deadline_budget_s(header_ms: str | None) -> float | None:
    """Seconds left to a request by its ``X-Request-Deadline-Ms`` header; None when absent."""
    if header_ms is None:
        return None
    try:
        ms = float(header_ms)
    except ValueError:
        raise APIError(
            400,
            "X-Request-Deadline-Ms must be a number of milliseconds",
            param="X-Request-Deadline-Ms",
        ) from None
    if not 0 < ms <= _MAX_DEADLINE_MS:
        raise APIError(400, "X-Request-Deadline-Ms must be positive", param="X-Request-Deadline-Ms")
    return ms / 1000.0


def objective_s(header: str, value: str | None) -> float | None:
    """Seconds a latency objective header (``TTFT_SLO_HEADER``, ``TPOT_SLO_HEADER``) allows;
    None when absent; a 400 naming the header when it is no positive number of ms."""
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= _MAX_DEADLINE_MS:  # nan fails too
        raise APIError(400, f"{header} must be a positive number of milliseconds", param=header)
    return ms / 1000.0


# ----- requests -----

# Every stop string is looked for after every token, and the text held back while it may be the
# start of one is found by trying each prefix: both bounded, the count as OpenAI bounds it.
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
# Each sampled token is looked up among these (a list, not a set, in the engine).
MAX_STOP_TOKEN_IDS = 256


def stop_problem(stop: object) -> str | None:
    """Why ``stop`` is out of bounds, or None. Types are not this function's business: a value
    that is neither a string nor a list passes here and fails validation."""
    sequences = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(sequences) > MAX_STOP_SEQUENCES:
        return f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(sequences)}"
    longest = max((len(s) for s in sequences if isinstance(s, str)), default=0)
    if longest > MAX_STOP_CHARS:
        return f"a stop sequence may be at most {MAX_STOP_CHARS} characters, got {longest}"
    return None


class ResumeState(BaseModel):
    """Where a broken stream stood, as the gateway saw it in ``STREAM_TOKENS_HEADER`` notes."""

    model_config = ConfigDict(extra="forbid")
    token_ids: list[int] = Field(max_length=1 << 20)
    text_chars: int = Field(ge=0)
    id: str | None = Field(default=None, max_length=200)
    created: int | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # ``schema`` shadows a BaseModel attribute: read it as ``json_schema``.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    min_p: float | None = Field(default=None, ge=0, le=1)
    user: str | None = Field(default=None, max_length=256)  # logged with the request, not used
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    # Above -(2**31): that one is the replica's own health probe's, which no request may tie.
    priority: int | None = Field(default=None, gt=-(2**31), le=2**31 - 1)
    # poise's own: continue a stream another replica began (the gateway's mid-stream failover)
    poise_resume: ResumeState | None = None
    # Structured output: OpenAI's response_format, and vLLM's extras for the same (at most one).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stop(cls, value: object) -> object:
        # Before the type check: 10,000 stop strings are refused for their number, unread.
        problem = stop_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=128)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


def _decoded_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text as it came
    return {**call, "function": {**function, "arguments": arguments}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # What chat templates read besides the text (vLLM's names): an assistant's calls, the call a
    # tool message answers, the reasoning of an earlier turn.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as its chat template sees it: the fields the client sent, text joined.

        None fields are left out, as transformers leaves them out: templates test for a missing
        key, and many would print "None". A tool call's ``arguments``, JSON text on OpenAI's
        wire, reach the template as the object they encode, as vLLM passes them: templates
        write them with ``tojson``, which would encode the text a second time.
        """
        out: dict[str, Any] = {}
        for field in type(self).model_fields:
            value = getattr(self, field)
            if field in self.model_fields_set and value is not None:
                out[field] = self.text() if field == "content" else value
        if self.tool_calls:
            out["tool_calls"] = [_decoded_arguments(c) for c in self.tool_calls]
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(
                    400, f"content parts of type {part.type!r} are not supported", "messages"
                )
            parts.append(part.text)
        return "".join(parts)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class _ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _ChosenFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # The chat template's inputs, as vLLM takes them.
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last message, to go on
    echo: bool = False  # vLLM's: the answer starts with the last message's text (an assistant's)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None  # a name of one of the model's templates, or a template
    chat_template_kwargs: dict[str, Any] | None = None


StreamOptions.model_rebuild()
_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


# ----- responses -----


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "poise"
    max_model_len: int | None = None
    # Its answers are the same bit for bit whatever else is in the batch (poise's own field).
    deterministic: bool = False


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
