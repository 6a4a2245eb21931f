"""vLLM's ``/tokenize`` and ``/detokenize``: the model's own tokenizer and chat template, served.

A client counts a prompt's tokens (or sees how a chat renders) exactly as the engine would,
without generating. Shapes are vLLM's: ``{"count", "max_model_len", "tokens", "token_strs"}``
and ``{"prompt"}``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from poise.engine.errors import InvalidRequestError
from poise.protocol import APIError, ChatMessage, Tool
from poise.server.replica import Replica

# As a prompt's: ids past this are no token of any model poise serves.
_MAX_TOKENS = 1 << 20


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(max_length=_MAX_TOKENS)


def tokenize(replica: Replica, body: TokenizeRequest) -> dict[str, Any]:
    tokenizer = replica.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.messages is not None:
        tools = (
            None if body.tools is None else [t.model_dump(exclude_none=True) for t in body.tools]
        )
        try:
            text = tokenizer.apply_chat_template(
                [m.template_dict() for m in body.messages],
                body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=tools,
                chat_template_kwargs=body.chat_template_kwargs,
            )
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        add_special = bool(body.add_special_tokens)  # the template wrote them
    else:
        assert body.prompt is not None
        text = body.prompt
        add_special = body.add_special_tokens is not False
    ids = tokenizer.encode(text, add_special_tokens=add_special)
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return {
        "count": len(ids),
        "max_model_len": replica.engine.max_model_len,
        "tokens": ids,
        "token_strs": strs if body.return_token_strs else None,
    }


def detokenize(replica: Replica, body: DetokenizeRequest) -> dict[str, Any]:
    vocab = replica.engine.intake.limits.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
    return {"prompt": replica.engine.tokenizer.decode(body.tokens)}
