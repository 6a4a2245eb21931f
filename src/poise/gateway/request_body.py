"""What the gateway reads of a request body: the few fields it needs, never more.

The bytes are forwarded as they came; these helpers look at the parsed JSON only for the model,
whether it streams and can be resumed, the prompt's text (for affinity and the token estimate)
and the most it may generate. What no backend should be sent is refused here, with the replica's
own words: a body ``protocol_body`` cannot read (not UTF-8, a lone surrogate, ``NaN``, too deep)
and stop sequences past OpenAI's bounds. Other fields are the backend's to judge. Of a
passthrough route's body (``body_model``) only the model is read: a JSON one's, or a multipart
one's text field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from poise.asgi import is_json_type
from poise.protocol import APIError, stop_problem
from poise.protocol_body import read_json_body

# A part's name in its Content-Disposition (``form-data; name="model"``), not ``filename=``.
_PART_NAME = re.compile(rb'content-disposition:[^\r\n]*;\s*name="?([^";\r\n]*)', re.IGNORECASE)
_BOUNDARY = re.compile(r';\s*boundary="?([^";]+)"?', re.IGNORECASE)


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


def body_model(body: bytes, content_type: str | None) -> tuple[str | None, dict[str, Any] | None]:
    """The model a passthrough route's body names (or None), and the body as a JSON object when
    it is one.

    A JSON body (a JSON content type, or none) is read by the same strict rules as the
    completions routes' (400 for what no backend should be sent) and names its ``model`` when
    that is a string. A ``multipart/form-data`` body names the value of its text part ``model``,
    found by scanning the parts' headers, never parsing the files. Any other body, or none, names
    no model.
    """
    if not body:
        return None, None
    if content_type is None or is_json_type(content_type.encode("latin-1")):
        data = read_json_body(body)
        if not isinstance(data, dict):
            return None, None
        model = data.get("model")
        return (model if isinstance(model, str) else None), data
    if content_type.lower().startswith("multipart/form-data"):
        return form_field(body, content_type, "model"), None
    return None, None


def form_field(body: bytes, content_type: str, name: str) -> str | None:
    """The value of the first part called ``name`` of a multipart/form-data body, if it is text."""
    found = _BOUNDARY.search(content_type)
    if found is None:
        return None
    delimiter = b"--" + found.group(1).strip().encode("latin-1")
    wanted = name.encode()
    at = body.find(delimiter)
    while at >= 0:
        start = at + len(delimiter)
        if body.startswith(b"--", start):  # the closing delimiter
            return None
        end = body.find(delimiter, start)
        stop = len(body) if end < 0 else end
        head_end = body.find(b"\r\n\r\n", start, stop)
        if head_end < 0:
            return None
        part = _PART_NAME.search(body, start, head_end)
        if part is not None and part.group(1) == wanted:
            value = body[head_end + 4 : stop].removesuffix(b"\r\n")
            try:
                return value.decode().strip()
            except UnicodeDecodeError:
                return None
        at = end
    return None
