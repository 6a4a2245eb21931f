"""A request's output constraint, from whichever field asked for it, compiled before it queues.

OpenAI's ``response_format`` and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` and ``structured_outputs`` all say the same thing; a request may use one of
them (two would contradict each other, or agree by chance: either way a 400). On chat, a
required or named tool choice is a constraint of its own, and cannot be combined with another.
A constraint that does not compile is a 400 naming its field, before the request is queued.
"""

from __future__ import annotations

import asyncio
from typing import Any

from poise.engine.errors import InvalidRequestError
from poise.engine.intake import RequestFactory
from poise.engine.structured import GuidedDecoding, GuidedKind, compile_guided
from poise.protocol import APIError, ChatCompletionRequest, CompletionRequest
from poise.server.tool_calls import plan_tools, tool_guided


def _asked(body: CompletionRequest | ChatCompletionRequest) -> list[tuple[GuidedKind, Any, str]]:
    asked: list[tuple[GuidedKind, Any, str]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
        raise APIError(
            400,
            f'response_format of type "{fmt.type}" takes no json_schema (use "json_schema")',
            param="response_format.json_schema",
        )
    if fmt is not None and fmt.type == "json_object":
        asked.append(("json_object", {"type": "object"}, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema
        if spec is None:
            raise APIError(
                400,
                'response_format of type "json_schema" needs its json_schema',
                param="response_format.json_schema",
            )
        if spec.description is not None:
            # OpenAI shows it to the model; poise enforces the schema and changes no prompt.
            raise APIError(
                400,
                "response_format.json_schema.description is not used by this server (the "
                "schema is enforced; describe the format in the messages instead)",
                param="response_format.json_schema.description",
            )
        # OpenAI's strict mode is what a grammar gives anyway: the schema is always enforced.
        schema = spec.json_schema if spec.json_schema is not None else {}
        asked.append(("json_schema", schema, "response_format.json_schema.schema"))
    for kind, value, param in (
        ("json_schema", body.guided_json, "guided_json"),
        ("regex", body.guided_regex, "guided_regex"),
        ("choice", body.guided_choice, "guided_choice"),
        ("grammar", body.guided_grammar, "guided_grammar"),
    ):
        if value is not None:
            asked.append((kind, value, param))  # type: ignore[arg-type]
    so = body.structured_outputs
    if so is not None:
        for kind, value, param in (
            ("json_schema", so.json_, "structured_outputs.json"),
            ("regex", so.regex, "structured_outputs.regex"),
            ("choice", so.choice, "structured_outputs.choice"),
            ("grammar", so.grammar, "structured_outputs.grammar"),
            ("json_object", {"type": "object"} if so.json_object else None, "structured_outputs"),
        ):
            if value is not None:
                asked.append((kind, value, param))  # type: ignore[arg-type]
        if not any(p.startswith("structured_outputs") for _, _, p in asked):
            raise APIError(400, "structured_outputs names no constraint", "structured_outputs")
    return asked


def guided_for(
    body: CompletionRequest | ChatCompletionRequest, tools: GuidedDecoding | None = None
) -> GuidedDecoding | None:
    """The one constraint the request asks for, compiled; None for free text."""
    asked = _asked(body)
    if len(asked) + (tools is not None) > 1:
        params = [p for _, _, p in asked] + (["tool_choice"] if tools is not None else [])
        raise APIError(
            400,
            f"a request may ask for one output constraint; this one asks for {len(params)}: "
            + ", ".join(params),
            param=params[-1],
        )
    if tools is not None:
        return tools
    if not asked:
        return None
    kind, value, param = asked[0]
    try:
        return compile_guided(kind, value, param)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def logit_bias_for(body: CompletionRequest | ChatCompletionRequest) -> dict[int, float] | None:
    """OpenAI's token-id strings as integers; the values' range is the sampler's to check."""
    if not body.logit_bias:
        return None
    out = {}
    for key, value in body.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        out[token] = value
    return out


def constraint_of(body: CompletionRequest | ChatCompletionRequest) -> GuidedDecoding | None:
    """The constraint the request will run under, for checking it before planning; None when
    it has none or the planning will refuse it anyway (with its own 400)."""
    try:
        forced = None
        if (
            isinstance(body, ChatCompletionRequest)
            and body.tools
            and body.tool_choice
            not in (
                None,
                "auto",
                "none",
            )
        ):
            plan = plan_tools(body, None, None)
            forced = None if plan is None else tool_guided(plan)
        return guided_for(body, forced)
    except (APIError, InvalidRequestError):
        return None


async def check_constraint(
    intake: RequestFactory, body: CompletionRequest | ChatCompletionRequest
) -> None:
    """A new constraint tried by the grammar checker off the event loop (up to its time limit);
    the planning that follows finds the verdict cached. Raises the 400 of one that fails."""
    guided = constraint_of(body)
    if guided is None:
        return
    try:
        await asyncio.to_thread(intake.check_guided, guided)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
