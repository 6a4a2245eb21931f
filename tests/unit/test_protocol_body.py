"""A request body read as JSON by poise's rules: what Python's ``json`` lets through and a server
must not (lone surrogates, other encodings, NaN, nesting to the recursion limit) is a 400 that
says what is wrong, and a clean body reads as before."""

import json

import pytest

from poise.protocol import APIError
from poise.protocol_body import MAX_DEPTH, read_json_body


def refused(body: bytes) -> APIError:
    with pytest.raises(APIError) as err:
        read_json_body(body)
    assert err.value.status == 400
    json.dumps(err.value.body()).encode()  # the answer itself must be sendable
    return err.value


def test_a_clean_body_reads_as_json_does():
    body = {"model": "m", "prompt": [[1, 2], [3]], "temperature": 0.5, "stop": ["\n"]}
    assert read_json_body(json.dumps(body).encode()) == body
    assert read_json_body(b'{"p": "\\ud83d\\ude00 caf\\u00e9 \\u0000"}') == {"p": "😀 café \0"}
    assert read_json_body('{"p": "😀"}'.encode()) == {"p": "😀"}
    # An escaped backslash before "ud800" is text, not an escape.
    assert read_json_body(b'{"p": "\\\\ud800"}') == {"p": "\\ud800"}


def test_a_byte_order_mark_is_ignored_as_rfc_8259_allows():
    assert read_json_body(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "a\xff"}',
        b'{"prompt": "\xc3("}',
        b'{"prompt": "\xed\xa0\x80"}',  # a surrogate encoded as UTF-8: json's surrogatepass
        b'{"prompt": "\xc0\xaf"}',  # an overlong encoding
        '{"prompt": "x"}'.encode("utf-16"),  # json.loads(bytes) would guess UTF-16
        '{"prompt": "x"}'.encode("utf-32"),
    ],
)
def test_bytes_that_are_not_utf8_are_refused(body):
    assert "not valid UTF-8" in refused(body).message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "\\ud800"}', "prompt"),
        (b'{"prompt": "a\\udc00b"}', "prompt"),
        (b'{"prompt": "\\ude00\\ud83d"}', "prompt"),  # a pair in the wrong order
        (b'{"messages": [{"role": "user", "content": "\\uD800"}]}', "messages.0.content"),
        (b'{"stop": ["ok", "\\udbff"]}', "stop.1"),
        (b'{"tools": [{"\\ud800": 1}]}', "tools.0"),  # a key: named by what holds it
        (b'"\\ud800"', None),
    ],
)
def test_a_lone_surrogate_is_refused_and_located(body, param):
    err = refused(body)
    assert "lone UTF-16 surrogate" in err.message and err.param == param


@pytest.mark.parametrize(
    "body",
    [b'{"max_tokens": NaN}', b'{"temperature": Infinity}', b'{"a": -Infinity}', b'{"a": 1e999}'],
)
def test_numbers_json_has_no_place_for_are_refused(body):
    assert "not valid JSON" in refused(body).message


def test_an_integer_python_will_not_convert_is_a_400_not_a_500():
    assert "too many digits" in refused(b'{"max_tokens": ' + b"9" * 5000 + b"}").message


def test_nesting_is_bounded_before_anything_recurses_over_it():
    ok = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert read_json_body(ok) is not None
    too_deep = b'{"chat_template_kwargs": {"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}}"
    err = refused(too_deep)
    assert "nests deeper" in err.message and err.param == "chat_template_kwargs"
    # Past the recursion limit json.loads itself gives up: a 400 too, not a RecursionError.
    assert "nests deeper" in refused(b"[" * 100_000 + b"]" * 100_000).message


def test_many_brackets_at_a_shallow_depth_are_fine():
    body = {"prompt": [[i, i + 1] for i in range(5000)], "tools": [{"a": {"b": [1]}}] * 100}
    assert read_json_body(json.dumps(body).encode()) == body


@pytest.mark.parametrize(
    "body", [b"", b"{not json", b'{"a": 1}{"b": 2}', b'{"a": "\x00"}', b"{'a': 1}"]
)
def test_what_is_not_json_says_so(body):
    assert "not valid JSON" in refused(body).message
