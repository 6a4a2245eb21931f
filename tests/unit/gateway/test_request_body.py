"""What the gateway refuses itself rather than forward: a body no backend should be sent (not
UTF-8, a lone surrogate, NaN, too deep) and stop sequences past OpenAI's bounds; and the model a
passthrough route's body names."""

import json

import httpx
import pytest

from poise.gateway.request_body import body_model, parse_body
from poise.protocol import APIError


def refused(body: bytes) -> APIError:
    with pytest.raises(APIError) as err:
        parse_body(body)
    assert err.value.status == 400
    return err.value


def test_a_clean_body_is_read():
    assert parse_body(b'{"model": "m", "prompt": "x", "stop": ["a", "b"]}')["stop"] == ["a", "b"]


def test_a_lone_surrogate_is_refused_not_forwarded():
    err = refused(b'{"model": "m", "prompt": "\\ud800"}')
    assert err.param == "prompt" and "surrogate" in err.message


@pytest.mark.parametrize("raw", [b'{"model": "m", "prompt": "\xff"}', b'{"model": "\xed\xa0\x80"}'])
def test_bytes_that_are_not_utf8_are_refused(raw):
    assert "UTF-8" in refused(raw).message


def test_stop_sequences_past_the_bounds_are_refused():
    many = {"model": "m", "prompt": "x", "stop": [str(i) for i in range(10_000)]}
    err = refused(json.dumps(many).encode())
    assert err.param == "stop" and "at most 4" in err.message
    long = {"model": "m", "prompt": "x", "stop": "s" * 1000}
    assert refused(json.dumps(long).encode()).param == "stop"


def test_nesting_past_the_bound_is_a_400_not_a_recursion_error():
    assert "nests deeper" in refused(b"[" * 100_000 + b"]" * 100_000).message


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    """The files first, then the fields (httpx puts fields first)."""
    request = httpx.Request("POST", "http://x/", data=fields, files=files)
    ctype = request.headers["content-type"]
    delimiter = b"--" + ctype.split("boundary=")[1].encode()
    parts = request.read().split(delimiter)[1:-1]
    reordered = parts[len(fields) :] + parts[: len(fields)]
    return b"".join(delimiter + p for p in reordered) + delimiter + b"--\r\n", ctype


def test_a_passthrough_body_names_its_model_as_json_or_as_a_multipart_field():
    assert body_model(b'{"model": "m", "input": "x"}', "application/json")[0] == "m"
    assert body_model(b'{"model": "m"}', None) == ("m", {"model": "m"})  # no type: JSON
    assert body_model(b'{"model": 7}', "application/json")[0] is None
    assert body_model(b"[1]", "application/json") == (None, None)
    assert body_model(b"", None) == (None, None)
    assert body_model(b"model=m", "application/x-www-form-urlencoded") == (None, None)
    with pytest.raises(APIError):  # read by the completions routes' rules
        body_model(b'{"model": NaN}', "application/json")
    # A file part whose bytes and name look like a model field fools nothing; the field after
    # it is found, and its value is the text as sent.
    audio = b'\r\n\r\nContent-Disposition: form-data; name="model"\r\n\r\nfake\r\n'
    body, ctype = multipart({"model": " whisper-1 "}, {"file": ("model", audio)})
    assert body_model(body, ctype) == ("whisper-1", None)
    body, ctype = multipart({"language": "en"}, {"file": ("a.wav", audio)})
    assert body_model(body, ctype) == (None, None)
    assert body_model(body, "multipart/form-data") == (None, None)  # no boundary
