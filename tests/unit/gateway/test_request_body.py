"""What the gateway refuses itself rather than forward: a body no backend should be sent (not
UTF-8, a lone surrogate, NaN, too deep) and stop sequences past OpenAI's bounds."""

import json

import pytest

from poise.gateway.request_body import parse_body
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
