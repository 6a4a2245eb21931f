"""What the gateway reads of a request body: the few fields it needs, never more.

The bytes are forwarded as they came; these helpers look at the parsed JSON only for the model,
whether it streams and can be resumed, the prompt's text (for affinity and the token estimate)
and the most it may generate. What no backend should be sent is refused here, with the replica's
own words: a body ``protocol_body`` cannot read (not UTF-8, a lone surrogate, ``NaN``, too deep)
and stop sequences past OpenAI's bounds. Other fields are the backend's to judge.
"""

from __future__ import annotations

import json
from typing import Any

from poise.protocol import APIError, stop_problem
from poise.protocol_body import read_json_body


def parse_body(body: bytes) -> dict[str, Any]:
    data = read_json_body(body)
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    if not isinstance(data.get("model"), str):
        raise APIError(400, "model is required", param="model")
    if "poise_resume" in data:
        # Set by the gateway on a resumed stream, which replicas admit past their wait bound:
        # a client sending it would jump the queue.
        raise APIError(
            400, "poise_resume is set by the gateway only, not by clients", param="poise_resume"
        )
    problem = stop_problem(data.get("stop"))
    if problem is not None:
        raise APIError(400, f"stop: {problem}", param="stop")
    return data


def resumable(data: dict[str, Any]) -> bool:
    """One streamed choice without logprobs: what a poise backend can resume mid-stream."""
    return (data.get("n") in (None, 1)) and not data.get("logprobs") and not data.get("echo")


def prompt_text(data: dict[str, Any]) -> str:
    if "messages" in data and isinstance(data["messages"], list):
        parts = []
        for m in data["messages"]:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
        return "\n".join(parts)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else json.dumps(prompt)[:512]


def max_output_tokens(data: dict[str, Any]) -> float:
    max_tokens = data.get("max_tokens") or data.get("max_completion_tokens") or 256
    n = data.get("n") or 1
    try:
        return float(max_tokens) * float(n)
    except (TypeError, ValueError):
        return 256.0


def estimate_tokens(data: dict[str, Any], text: str) -> float:
    """Prompt (about four characters a token) plus the most the answer may use."""
    return len(text) / 4 + max_output_tokens(data)
