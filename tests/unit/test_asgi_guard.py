"""The body guard (type, size, time to arrive) and the last-resort error handler, driven as plain
ASGI apps with fake ``receive``/``send``."""

import asyncio
import json
import logging

import pytest
from starlette.types import Message, Receive, Scope, Send

from poise.asgi import ErrorShield, GuardMiddleware, is_json_type


def scope(headers: list[tuple[bytes, bytes]], method: str = "POST") -> Scope:
    return {"type": "http", "method": method, "path": "/v1/completions", "headers": headers}


class Recorder:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"])

    def error(self) -> dict:
        return json.loads(self.messages[1]["body"])["error"]


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    body = (await receive())["body"]
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def body_receive(body: bytes) -> Receive:
    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (b"application/json", True),
        (b"Application/JSON; charset=UTF-8", True),
        (b"application/merge-patch+json", True),
        (b'application/json; charset="utf8"', True),
        (b"application/json; charset=utf-16", False),
        (b"text/plain", False),
        (b"application/x-www-form-urlencoded", False),
        (b"multipart/form-data; boundary=x", False),
        (b"", False),
    ],
)
def test_json_content_types(value, ok):
    assert is_json_type(value) is ok


async def test_a_body_that_is_not_json_is_415_before_it_is_read():
    guard = GuardMiddleware(echo, max_body_bytes=1024, api_keys=[])
    sent = Recorder()
    await guard(scope([(b"content-type", b"text/plain")]), body_receive(b"{}"), sent)
    assert sent.status == 415 and sent.error()["param"] == "Content-Type"
    for headers in ([], [(b"content-type", b"application/json")]):
        sent = Recorder()
        await guard(scope(headers), body_receive(b"{}"), sent)
        assert sent.status == 200 and sent.messages[1]["body"] == b"{}"


async def test_a_forwarded_path_takes_any_type_and_a_bounded_body_in_any_method():
    guard = GuardMiddleware(
        echo, max_body_bytes=1024, api_keys=[], forwarded=lambda p: p == "/v1/audio/speech"
    )
    forwarded = {**scope([(b"content-type", b"audio/wav")]), "path": "/v1/audio/speech"}
    sent = Recorder()
    await guard(forwarded, body_receive(b"RIFF"), sent)
    assert sent.status == 200 and sent.messages[1]["body"] == b"RIFF"
    sent = Recorder()
    await guard({**forwarded, "method": "DELETE"}, body_receive(b"x" * 1025), sent)
    assert sent.status == 413
    sent = Recorder()  # other paths keep the rule
    await guard(scope([(b"content-type", b"audio/wav")]), body_receive(b"RIFF"), sent)
    assert sent.status == 415


async def test_a_client_that_stalls_after_its_headers_gets_408_and_the_connection_closes():
    guard = GuardMiddleware(echo, max_body_bytes=1024, api_keys=[], body_timeout_s=0.05)
    never = asyncio.Event()

    async def stalled() -> Message:
        await never.wait()
        raise AssertionError("unreachable")

    sent = Recorder()
    await asyncio.wait_for(guard(scope([(b"content-length", b"10")]), stalled, sent), 5)
    assert sent.status == 408 and sent.headers[b"connection"] == b"close"
    assert sent.error()["code"] == "body_timeout"


async def test_an_unexpected_error_is_a_500_in_openai_shape_and_not_raised_on():
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise TypeError("a bug")

    sent = Recorder()
    # Not raised: uvicorn would drop the connection, and a keep-alive client's next request.
    await ErrorShield(broken, logging.getLogger("test"))(scope([]), body_receive(b""), sent)
    assert sent.status == 500
    assert sent.error() == {
        "message": "internal error: TypeError",
        "type": "internal_error",
        "param": None,
        "code": None,
    }


async def test_an_error_after_the_answer_began_still_breaks_the_connection():
    async def half(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise TypeError("mid-answer")

    sent = Recorder()
    with pytest.raises(TypeError):
        await ErrorShield(half, logging.getLogger("test"))(scope([]), body_receive(b""), sent)
    assert len(sent.messages) == 1
