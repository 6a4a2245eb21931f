"""A request body read as JSON by one set of rules, the same at a replica and at the gateway.

Python's ``json`` is lenient where a server must not be: it guesses UTF-16 and UTF-32 from the
first bytes, passes UTF-8-encoded surrogates (``surrogatepass``) and escaped lone surrogates
(``"\\ud800"``) into ``str`` objects that no tokenizer, encoder or socket accepts later, takes
``NaN`` and ``Infinity``, and nests as deep as the C stack allows. Each of those ended in a 500
or a dropped connection far from the parser; here each is a 400 that names the problem:

- the body is UTF-8 (RFC 8259 §8.1); a leading byte order mark is ignored, as the RFC allows;
- it is one JSON value without ``NaN``/``Infinity`` and with every number finite;
- it nests at most ``MAX_DEPTH`` arrays and objects;
- no string holds a lone surrogate (a pair, ``"\\ud83d\\ude00"``, is one character and fine).

Size is not checked here: ``GuardMiddleware`` refused an oversized body before it was read.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from poise.protocol import APIError

# Deeper than any real request (a tool's JSON schema nests a few levels a property), far below
# the recursion limit that pydantic, Jinja's ``tojson`` and ``json.dumps`` run into further on.
MAX_DEPTH = 64

_BOM = "\ufeff"
# A ``\u`` escape of a UTF-16 surrogate (D800-DFFF). Only a body that has one can hold a lone
# surrogate once strict UTF-8 decoding has passed, so only such a body is walked to find it.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class _NotJsonError(ValueError):
    """A number the JSON grammar has no place for (``NaN``, ``Infinity``, ``1e999``)."""


def _constant(name: str) -> Any:
    raise _NotJsonError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJsonError(f"the number {text[:40]} is out of range")
    return value


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_body")


def read_json_body(body: bytes) -> Any:
    """The body's JSON value, or an ``APIError`` (400) saying what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    if text.startswith(_BOM):
        text = text[1:]
    try:
        data = json.loads(text, parse_constant=_constant, parse_float=_finite)
    except _NotJsonError as exc:
        raise _bad(f"the request body is not valid JSON: {exc}") from None
    except json.JSONDecodeError as exc:
        raise _bad(
            f"the request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise _bad(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # an integer of more digits than Python converts (4,300)
        raise _bad("the request body is not valid JSON: a number has too many digits") from None
    # Counting brackets is cheap and over-counts (those inside strings too): only a body with
    # more of them than the depth allowed, or with a surrogate escape, needs the walk.
    deep = text.count("[") + text.count("{") > MAX_DEPTH
    strings = _SURROGATE_ESCAPE.search(text) is not None
    if isinstance(data, str) and strings:
        _check_string(data, [])
    elif isinstance(data, dict | list) and (deep or strings):
        _walk(data, [], 0, strings)
    return data


def _check_string(value: str, path: list[str | int], key: bool = False) -> None:
    """``path`` leads to the string; for a key, to the object holding it (the key itself cannot
    go into the answer: it is not encodable)."""
    if _SURROGATE.search(value) is not None:
        where = ".".join(map(str, path)) or None
        what = "a key" if key else "a string"
        raise _bad(
            f"{where or 'the body'}: {what} holds a lone UTF-16 surrogate, which is not a "
            "character (a \\ud800-\\udfff escape without its pair)",
            where,
        )


_CONTAINERS = frozenset({dict, list})


def _walk(
    value: dict[str, Any] | list[Any], path: list[str | int], depth: int, strings: bool
) -> None:
    """Raises at a container nested past ``MAX_DEPTH`` or, with ``strings``, at a string (key
    or value) holding a lone surrogate."""
    if depth >= MAX_DEPTH:  # named by the top-level field: the whole path is noise
        where = str(path[0]) if path else None
        raise _bad(f"the request body nests deeper than {MAX_DEPTH} levels", where)
    if isinstance(value, list):
        # A prompt of token ids is a long list of numbers: skip it at C speed.
        kinds = set(map(type, value))
        if kinds.isdisjoint(_CONTAINERS) and not (strings and str in kinds):
            return
        items: Any = enumerate(value)
    else:
        items = value.items()
    for key, item in items:
        if strings and isinstance(key, str):
            _check_string(key, path, key=True)
        path.append(key)
        kind = type(item)
        if kind is str:
            if strings:
                _check_string(item, path)
        elif kind in _CONTAINERS:
            _walk(item, path, depth + 1, strings)
        path.pop()
