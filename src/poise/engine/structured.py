"""What a structured output must match, compiled once into a grammar llguidance runs.

The grammar engine is llguidance (guidance-ai), the one vLLM's ``guidance`` backend and SGLang
use, rather than xgrammar: it computes each token mask on demand from an Earley parser over a
lexer, so a typical schema costs no ahead-of-time compilation (a new one starts in
milliseconds; the pathological ones are caught by ``grammar_check``), its masks for a whole
batch are computed in parallel outside the GIL, and it installs as one self-contained wheel
(xgrammar pulls in triton and transformers). It takes JSON schemas, regular expressions, Lark
grammars (and GBNF, converted) and choices, which is every request format OpenAI and vLLM
define.

JSON is compiled without free whitespace (``,`` and ``:`` as separators, nothing between
tokens): with whitespace allowed anywhere, a model may spend all of ``max_tokens`` on it (a
random-weight model did, here), and the answer never closes. Unknown schema keywords are
refused, not ignored (``lenient`` off): a constraint poise cannot enforce is a 400 naming it.
Keywords no JSON Schema version defines are ignored, as the JSON Schema specification says.

The grammar's text is made at intake, in the front end's process, and cached by its source;
``grammar_check`` then compiles it, builds a matcher and computes a first mask in a child
process, within a time limit, before the request is queued (a crash or a timeout there is the
request's 400). The engine core builds its matcher from the same text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from poise.engine.errors import InvalidRequestError

GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
    "lenient": False,
}
# The largest source text compiled: a grammar is a request's input like its prompt.
MAX_SOURCE_CHARS = 256 * 1024
_CACHED = 256


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """One request's output constraint: where it came from and llguidance's grammar for it."""

    kind: GuidedKind
    source: str  # the schema, regex, grammar or choices as given (JSON text for the first)
    grammar: str  # llguidance's serialized grammar
    param: str  # the request field that asked for it, for errors


def _grammar_for(kind: GuidedKind, source: str) -> str:
    from llguidance import LLMatcher, grammar_from

    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(source, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    if kind == "choice":
        choices = json.loads(source)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    # A grammar: Lark as llguidance reads it, or GBNF (llama.cpp's), converted.
    return grammar_from("grammar", source)


@lru_cache(maxsize=_CACHED)
def _compile(kind: GuidedKind, source: str) -> str:
    """The grammar's text, or ValueError saying what is wrong with the source. Not yet
    validated: that runs the grammar compiler, which ``grammar_check`` keeps in a child
    process (a schema of chained $refs overflows its stack)."""
    return _grammar_for(kind, source)


def compile_guided(kind: GuidedKind, source: Any, param: str) -> GuidedDecoding:
    """A request's constraint, compiled (or from the cache); a 400-worthy error names ``param``.

    ``source`` is a schema (a dict, or its JSON text), a regex or grammar string, or a list of
    choices."""
    if kind in ("json_schema", "json_object", "choice") and not isinstance(source, str):
        text = json.dumps(source, ensure_ascii=False)  # in its order: properties come so
    elif isinstance(source, str):
        text = source
    else:
        raise InvalidRequestError(f"{param} must be a string", param=param)
    if len(text) > MAX_SOURCE_CHARS:
        raise InvalidRequestError(
            f"{param} is {len(text)} characters; at most {MAX_SOURCE_CHARS} are compiled",
            param=param,
        )
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError:
            raise InvalidRequestError(f"{param} is not valid JSON", param=param) from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(f"{param} must be a JSON schema (an object)", param=param)
    if kind == "choice":
        choices = json.loads(text)
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise InvalidRequestError(f"{param} must be a list of non-empty strings", param=param)
    if kind in ("regex", "grammar") and not text:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    try:
        grammar = _compile(kind, text)
    except ValueError as exc:
        raise InvalidRequestError(f"{param} cannot be enforced: {exc}", param=param) from None
    return GuidedDecoding(kind, text, grammar, param)
