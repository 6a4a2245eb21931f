"""Hostile input against real processes on loopback: a replica with an API key, and a gateway in
front of it. Each malformed body is a 4xx in OpenAI's error shape on a connection that stays
usable, and a normal request is answered after each group of them; stalled, half-open and many
connections never keep others from being served.

Cases go in groups, each on one keep-alive connection (a dropped connection fails the next case
of the group), with every failing case listed at the end rather than only the first.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from gatewayproc import GatewayProcess
from poise.protocol import ChatCompletionRequest, CompletionRequest
from serverproc import ServerProcess

REPLICA_KEY = "sk-replica-hostile"
GATEWAY_KEY = "sk-gateway-hostile"
BODY_TIMEOUT_S = 1.0
MAX_BODY = 4 << 20  # both servers' default
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_COMPLETION = {"model": "m", "prompt": "ok", "max_tokens": 1}
OK_CHAT = {"model": "m", "messages": [{"role": "user", "content": "ok"}], "max_tokens": 1}
ANY = object()  # a case whose param is not checked


@dataclass(frozen=True)
class Target:
    name: str
    host: str
    port: int
    key: str
    logs: tuple[Path, ...]  # the logs of every process a request to it reaches

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=30)

    @contextlib.contextmanager
    def connection(self) -> Iterator[http.client.HTTPConnection]:
        conn = self.connect()
        try:
            yield conn
        finally:
            conn.close()

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass(frozen=True)
class Case:
    id: str
    body: bytes
    status: int = 400
    param: object = ANY
    path: str = COMPLETIONS
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    # One of the cases: the gateway must answer it itself, never forward it.
    gateway_refuses: bool = False
    says: str = ""  # what the message must name (case aside)


def body(base: dict[str, Any], **fields: Any) -> bytes:
    return json.dumps({**base, **fields}).encode()


def raw(text: str) -> bytes:
    return text.encode()


# ----- the servers -----


@pytest.fixture(scope="module")
def replica(llama_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("hostile-replica")
    config = logs / "serve.yaml"
    config.write_text(f"body_timeout_s: {BODY_TIMEOUT_S}\n")
    flags = ("--max-model-len", "64", "--api-key", REPLICA_KEY, "--config", str(config))
    proc = ServerProcess(llama_dir, logs, *flags)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(replica, tmp_path_factory) -> Iterator[GatewayProcess]:
    config = {
        "models": {"m": {"backends": [{"url": replica.url, "api_key": REPLICA_KEY}]}},
        "keys": [{"key": GATEWAY_KEY, "name": "hostile"}],
        "body_timeout_s": BODY_TIMEOUT_S,
        "health": {"interval_s": 0.5, "timeout_s": 2.0, "healthy_after": 1, "unhealthy_after": 3},
    }
    proc = GatewayProcess(config, tmp_path_factory.mktemp("hostile-gateway"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module", params=["replica", "gateway"])
def target(request) -> Target:
    proc = request.getfixturevalue(request.param)
    key = REPLICA_KEY if request.param == "replica" else GATEWAY_KEY
    logs = (request.getfixturevalue("replica").log_path, proc.log_path)
    return Target(request.param, "127.0.0.1", proc.port, key, logs)


def send(
    conn: http.client.HTTPConnection, method: str, path: str, data: bytes | None, headers: dict
) -> tuple[int, dict[str, str], bytes]:
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def completes(target: Target, conn: http.client.HTTPConnection | None = None) -> None:
    """A normal request is answered (on ``conn`` when given: the connection survived too)."""
    headers = {**target.auth(), "Content-Type": "application/json"}
    with contextlib.closing(target.connect()) as own:
        status, _, data = send(conn or own, "POST", COMPLETIONS, body(OK_COMPLETION), headers)
    assert status == 200, data[:300]
    assert json.loads(data)["choices"][0]["finish_reason"] in ("stop", "length")


def no_handler_failed(target: Target) -> None:
    """A 500 is a bug whatever the input: none may have been logged."""
    for path in target.logs:
        text = path.read_text(errors="replace")
        assert "unhandled error" not in text and "Exception in ASGI application" not in text


def openai_error(data: bytes) -> dict[str, Any]:
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def run_cases(target: Target, cases: list[Case]) -> None:
    """Every case on one connection, then a normal request on it; every failure is listed."""
    conn = target.connect()
    failures = []

    def reconnect() -> http.client.HTTPConnection:
        conn.close()
        return target.connect()

    for case in cases:
        try:
            headers = {**target.auth(), **case.headers}
            status, answer_headers, data = send(conn, "POST", case.path, case.body, headers)
            assert status == case.status, f"status {status}: {data[:200]!r}"
            error = openai_error(data)
            assert case.param is ANY or error["param"] == case.param, f"param {error['param']}"
            assert case.says.lower() in error["message"].lower(), error["message"]
            if target.name == "gateway" and case.gateway_refuses:
                # A forwarded answer carries the attempt count; the gateway's own does not.
                assert "x-poise-attempt-count" not in answer_headers, "forwarded to a replica"
            if answer_headers.get("connection") == "close":
                conn = reconnect()
        except (AssertionError, OSError, http.client.HTTPException, ValueError) as exc:
            failures.append(f"{case.id}: {exc!r}"[:400])
            conn = reconnect()
    completes(target, conn)
    conn.close()
    assert not failures, "\n".join(failures)
    no_handler_failed(target)


# ----- bodies -----

ENCODINGS = [
    Case(
        "invalid utf-8",
        b'{"model": "m", "prompt": "a\xffb", "max_tokens": 1}',
        param=None,
        gateway_refuses=True,
        says="UTF-8",
    ),
    Case(
        "utf-8 encoded surrogate",
        b'{"model": "m", "prompt": "\xed\xa0\x80"}',
        param=None,
        gateway_refuses=True,
        says="UTF-8",
    ),
    Case(
        "overlong utf-8",
        b'{"model": "m", "prompt": "\xc0\xaf"}',
        gateway_refuses=True,
        says="UTF-8",
    ),
    Case(
        "latin-1 text", b'{"model": "m", "prompt": "caf\xe9"}', gateway_refuses=True, says="UTF-8"
    ),
    Case(
        "utf-16 body",
        json.dumps(OK_COMPLETION).encode("utf-16"),
        gateway_refuses=True,
        says="UTF-8",
    ),
    Case(
        "lone high surrogate",
        raw('{"model": "m", "prompt": "\\ud800", "max_tokens": 1}'),
        param="prompt",
        gateway_refuses=True,
        says="surrogate",
    ),
    Case(
        "lone low surrogate in chat",
        raw('{"model": "m", "messages": [{"role": "user", "content": "a\\udfffb"}]}'),
        path=CHAT,
        param="messages.0.content",
        gateway_refuses=True,
        says="surrogate",
    ),
    Case(
        "lone surrogate in a stop string",
        raw('{"model": "m", "prompt": "x", "stop": "\\udc00"}'),
        param="stop",
        gateway_refuses=True,
        says="surrogate",
    ),
    Case(
        "lone surrogate in the model",
        raw('{"model": "\\ud83d", "prompt": "x"}'),
        param="model",
        gateway_refuses=True,
        says="surrogate",
    ),
    Case(
        "lone surrogate in a key",
        raw('{"model": "m", "prompt": "x", "\\ud800": 1}'),
        gateway_refuses=True,
        says="surrogate",
    ),
    Case("raw NUL in a string", b'{"model": "m", "prompt": "a\x00b"}', gateway_refuses=True),
    Case("NUL outside strings", b'{"model": "m",\x00 "prompt": "x"}', gateway_refuses=True),
    Case("a byte order mark alone", b"\xef\xbb\xbf", gateway_refuses=True),
    Case("empty body", b""),
    Case("not json", b"{model: m}", gateway_refuses=True),
    Case("two documents", body(OK_COMPLETION) + body(OK_COMPLETION), gateway_refuses=True),
    Case("a json array", b"[1, 2]", gateway_refuses=True),
    Case("a json string", b'"hello"', gateway_refuses=True),
]


def test_encodings(target):
    run_cases(target, ENCODINGS)


def test_encodings_that_are_fine_are_served(target):
    """The other side of the rules: a byte order mark, an escaped NUL, a surrogate pair and
    no Content-Type at all are all accepted."""
    accepted = [
        (b"\xef\xbb\xbf" + body(OK_COMPLETION), "application/json"),
        (body(OK_COMPLETION, prompt="nul \u0000 and \U0001f600"), "application/json"),
        (body(OK_COMPLETION), None),
        (body(OK_COMPLETION), "application/json; charset=utf-8"),
        (body(OK_COMPLETION), "application/vnd.poise+json"),
    ]
    with target.connection() as conn:
        for data, content_type in accepted:
            headers = target.auth() | ({"Content-Type": content_type} if content_type else {})
            status, _, answer = send(conn, "POST", COMPLETIONS, data, headers)
            assert status == 200, (data[:60], answer[:300])


SIZES = [
    Case(
        "10,000 stop strings",
        body(OK_COMPLETION, stop=[f"s{i}" for i in range(10_000)]),
        param="stop",
        gateway_refuses=True,
        says="at most 4",
    ),
    Case(
        "5 stop strings",
        body(OK_COMPLETION, stop=list("abcde")),
        param="stop",
        gateway_refuses=True,
        says="at most 4",
    ),
    Case(
        "a 100,000-character stop string",
        body(OK_COMPLETION, stop="s" * 100_000),
        param="stop",
        gateway_refuses=True,
        says="characters",
    ),
    Case(
        "100,000 stop token ids",
        body(OK_COMPLETION, stop_token_ids=list(range(100_000))),
        param="stop_token_ids",
    ),
    Case("10,000 prompts", body(OK_COMPLETION, prompt=["x"] * 10_000), param="prompt"),
    Case("300 prompts of n=100", body(OK_COMPLETION, prompt=["x"] * 300, n=100), param="n"),
    Case(
        "a prompt of 100,000 token ids", body(OK_COMPLETION, prompt=[5] * 100_000), param="prompt"
    ),
    Case(
        "a 200,000-character prompt", body(OK_COMPLETION, prompt="word " * 40_000), param="prompt"
    ),
    Case(
        "2,000 messages",
        body(OK_CHAT, messages=[{"role": "user", "content": "hi"}] * 2000),
        path=CHAT,
        param="prompt",
    ),
    Case(
        "a megabyte model name",
        body(OK_COMPLETION, model="m" * (1 << 20)),
        status=404,
        param="model",
    ),
    Case("a megabyte field name", body(OK_COMPLETION, **{"x" * (1 << 20): 1})),
]


def test_sizes(target):
    run_cases(target, SIZES)


def test_a_body_over_the_limit_is_413(target):
    headers = {**target.auth(), "Content-Type": "application/json"}
    big = body(OK_COMPLETION, prompt="x" * MAX_BODY)
    with target.connection() as conn:
        status, _, data = send(conn, "POST", COMPLETIONS, big, headers)
        assert status == 413 and openai_error(data)["code"] == "body_too_large"
    # Chunked, no Content-Length: counted as it arrives.
    chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))
    with target.connection() as conn:
        conn.request("POST", COMPLETIONS, body=chunks, headers=headers, encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413
        assert openai_error(response.read())["code"] == "body_too_large"
    completes(target)


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


NESTING = [
    Case(
        "100,000 nested arrays",
        b"[" * 100_000 + b"]" * 100_000,
        gateway_refuses=True,
        says="nests deeper",
    ),
    Case(
        "10,000 nested objects",
        b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
        gateway_refuses=True,
        says="nests deeper",
    ),
    Case(
        "deep chat_template_kwargs",
        body(OK_CHAT, chat_template_kwargs=nested(100)),
        path=CHAT,
        param="chat_template_kwargs",
        gateway_refuses=True,
        says="nests deeper",
    ),
    Case(
        "deep tools",
        body(OK_CHAT, tools=[nested(100)]),
        path=CHAT,
        param="tools",
        gateway_refuses=True,
        says="nests deeper",
    ),
    Case(
        "deep prompt",
        body(OK_COMPLETION, prompt=json.loads("[" * 80 + "]" * 80)),
        param="prompt",
        gateway_refuses=True,
        says="nests deeper",
    ),
]


def test_nesting(target):
    run_cases(target, NESTING)


def number(text: str, **fields: Any) -> bytes:
    """A completion body with ``max_tokens`` (or another field) written as raw JSON text."""
    name, value = next(iter(fields.items())) if fields else ("max_tokens", text)
    return raw(f'{{"model": "m", "prompt": "x", "{name}": {value}}}')


NUMBERS = [
    Case("max_tokens -1", number("-1"), param="max_tokens"),
    Case("max_tokens 0", number("0"), param="max_tokens"),
    Case("max_tokens 1e30", number("1e30"), param="max_tokens"),
    Case("max_tokens 10**30", number("1" + "0" * 30), param="max_tokens"),
    Case("max_tokens 1.5", number("1.5"), param="max_tokens"),
    Case("max_tokens NaN", number("NaN"), gateway_refuses=True, says="NaN"),
    Case("max_tokens Infinity", number("Infinity"), gateway_refuses=True, says="Infinity"),
    Case("max_tokens -Infinity", number("-Infinity"), gateway_refuses=True, says="Infinity"),
    Case("max_tokens 1e999", number("1e999"), gateway_refuses=True, says="out of range"),
    Case("max_tokens of 5,000 digits", number("9" * 5000), gateway_refuses=True, says="digits"),
    Case("temperature -1", number("", temperature="-1"), param="temperature"),
    Case("temperature 2.5", number("", temperature="2.5"), param="temperature"),
    Case('temperature "NaN"', number("", temperature='"NaN"'), param="temperature"),
    Case(
        "temperature 1e400",
        number("", temperature="1e400"),
        gateway_refuses=True,
        says="out of range",
    ),
    Case("top_p 0", number("", top_p="0"), param="top_p"),
    Case("top_p 1.5", number("", top_p="1.5"), param="top_p"),
    Case("n 0", number("", n="0"), param="n"),
    Case("n 129", number("", n="129"), param="n"),
    Case("n 10**6", number("", n="1000000"), param="n"),
    Case("logprobs -1", number("", logprobs="-1"), param="logprobs"),
    Case("logprobs 21", number("", logprobs="21"), param="logprobs"),
    Case(
        "top_logprobs 21",
        body(OK_CHAT, logprobs=True, top_logprobs=21),
        path=CHAT,
        param="top_logprobs",
    ),
    Case(
        "top_logprobs without logprobs",
        body(OK_CHAT, top_logprobs=2),
        path=CHAT,
        param="top_logprobs",
    ),
    Case("presence_penalty 3", number("", presence_penalty="3"), param="presence_penalty"),
    Case("repetition_penalty 0", number("", repetition_penalty="0"), param="repetition_penalty"),
    Case("seed 2**64", number("", seed=str(2**64)), param="seed"),
    Case("priority 2**40", number("", priority=str(2**40)), param="priority"),
    Case("top_k -2", number("", top_k="-2"), param="top_k"),
    Case("min_tokens 10**21", number("", min_tokens=str(10**21)), param="min_tokens"),
    Case("min_p 2", number("", min_p="2"), param="min_p"),
    Case("a token id past the vocabulary", body(OK_COMPLETION, prompt=[10**9]), param="prompt"),
    Case("a negative token id", body(OK_COMPLETION, prompt=[-1]), param="prompt"),
    Case("an empty token list", body(OK_COMPLETION, prompt=[[]]), param="prompt"),
]


def test_numbers_out_of_range(target):
    run_cases(target, NUMBERS)


WRONG_VALUES: list[Any] = ["zz", 12345, {"x": 1}, [1]]


def wrong_types(model: type[BaseModel], base: dict[str, Any], path: str) -> list[Case]:
    """For every field of the request model, a value of a type it does not take (the first of
    ``WRONG_VALUES`` that the model refuses), which must be a 400 naming the field."""
    cases = []
    for name in model.model_fields:
        for value in WRONG_VALUES:
            data = {**base, name: value}
            try:
                model.model_validate(data)
            except ValidationError:
                cases.append(Case(f"{path} {name}={value!r}", body(data), param=name, path=path))
                break
    return cases


TYPES = (
    wrong_types(CompletionRequest, OK_COMPLETION, COMPLETIONS)
    + wrong_types(ChatCompletionRequest, OK_CHAT, CHAT)
    + [
        Case("messages of numbers", body(OK_CHAT, messages=[1, 2]), path=CHAT, param="messages.0"),
        Case(
            "a message without a role",
            body(OK_CHAT, messages=[{"content": "x"}]),
            path=CHAT,
            param="messages.0.role",
        ),
        Case(
            "an unknown role",
            body(OK_CHAT, messages=[{"role": "alien", "content": "x"}]),
            path=CHAT,
            param="messages.0.role",
        ),
        Case(
            "an image part",
            body(
                OK_CHAT,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ],
            ),
            path=CHAT,
            param="messages",
        ),
        Case("no prompt", body({"model": "m"}), param="prompt"),
        Case("no messages", body({"model": "m"}), path=CHAT, param="messages"),
        Case("empty messages", body(OK_CHAT, messages=[]), path=CHAT, param="messages"),
    ]
)


def test_wrong_types(target):
    assert len(TYPES) > 40  # every field of both requests
    run_cases(target, TYPES)


UNKNOWN_FIELDS = [
    Case(
        "an unknown field",
        body(OK_COMPLETION, foo=1),
        param="foo",
        says="Unrecognized request argument",
    ),
    Case(
        "functions (not honoured)",
        body(OK_CHAT, functions=[{"name": "f"}]),
        path=CHAT,
        param="functions",
    ),
    Case(
        "logit_bias out of the vocabulary",
        body(OK_COMPLETION, logit_bias={"99999999": 100}),
        param="logit_bias",
    ),
    Case(
        "a response_format of an unknown type",
        body(OK_CHAT, response_format={"type": "xml"}),
        path=CHAT,
        param="response_format.type",
    ),
    Case(
        "tool_choice without tools",
        body(OK_CHAT, tool_choice="required"),
        path=CHAT,
        param="tool_choice",
    ),
    Case(
        "an unknown stream option",
        body(
            OK_COMPLETION,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
        param="stream_options.continuous_usage_stats",
    ),
    Case(
        "poise_resume from a client",
        body(OK_COMPLETION, poise_resume={"token_ids": [1], "text_chars": 1}),
        param="poise_resume",
    ),
]


def test_unknown_fields_are_refused_by_name(target):
    cases = UNKNOWN_FIELDS
    if target.name == "replica":  # a client of the replica itself may resume (the gateway does)
        cases = [c for c in cases if c.param != "poise_resume"]
    run_cases(target, cases)


CONTENT_TYPES = [
    Case(
        f"Content-Type {value}",
        body(OK_COMPLETION),
        status=415,
        param="Content-Type",
        headers={"Content-Type": value},
        gateway_refuses=True,
    )
    for value in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=utf-16",
        "application/xml",
        "",
    )
]


def test_content_types_other_than_json_are_415(target):
    run_cases(target, CONTENT_TYPES)


# ----- headers -----


def test_bad_headers_are_4xx(target):
    json_type = {"Content-Type": "application/json"}
    with target.connection() as conn:

        def post(headers: dict[str, str]) -> dict[str, Any]:
            status, _, data = send(conn, "POST", COMPLETIONS, body(OK_COMPLETION), headers)
            return {"status": status} | openai_error(data)

        for value in ["soon", "-5", "0", "1e400", "nan", "9" * 5000]:
            error = post(target.auth() | json_type | {"X-Request-Deadline-Ms": value})
            assert error["status"] == 400 and error["param"] == "X-Request-Deadline-Ms", value
        if target.name == "replica":  # the gateway sets X-Priority itself, from the key
            error = post(target.auth() | json_type | {"X-Priority": "urgent"})
            assert error["status"] == 400 and error["param"] == "X-Priority"
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic eDp5"}):
            error = post(auth | json_type)
            assert error["status"] == 401 and error["code"] == "invalid_api_key"
        status, _, data = send(conn, "GET", COMPLETIONS, None, target.auth())
        assert status == 405 and openai_error(data)
        status, _, data = send(conn, "GET", "/v1/nothing-here", None, target.auth())
        assert status == 404 and openai_error(data)
        completes(target, conn)


def exchange(target: Target, request: bytes, read_s: float = 10.0) -> bytes:
    """``request`` on a fresh socket as it is, and all the server sends before closing or
    ``read_s`` passes."""
    with socket.create_connection((target.host, target.port), timeout=read_s) as s:
        s.sendall(request)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def test_malformed_http_is_refused_by_the_parser_and_serving_goes_on(target):
    """What uvicorn's parser refuses never reaches poise: a plain 400 and the connection closed
    (no OpenAI shape there, the app never saw the request)."""
    auth = f"Authorization: Bearer {target.key}\r\n".encode()
    start = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth
    data = body(OK_COMPLETION)
    for request in (
        start + b"Content-Length: abc\r\n\r\n" + data,
        start + b"Content-Length: -1\r\n\r\n" + data,
        start + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n" + data,
        start + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n" + data,
        start + b"X-Bad: a\x00b\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # TLS to a plain port
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ):
        answer = exchange(target, request, read_s=5)
        assert answer.startswith(b"HTTP/1.1 400 "), (request[:80], answer[:200])
    # A large header is no parser error (uvicorn sets no bound): it is served.
    big = start + b"X-Big: " + b"a" * 65536 + b"\r\nContent-Type: application/json\r\n"
    length = b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(data)
    answer = exchange(target, big + length + data)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    completes(target)


# ----- connections -----


def test_a_client_that_stalls_after_its_headers_is_timed_out_and_others_are_served(target):
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {target.key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    ).encode()
    with socket.create_connection((target.host, target.port), timeout=BODY_TIMEOUT_S + 10) as s:
        s.sendall(head + b'{"model": "m", ')  # 15 of 100 bytes, then nothing
        started = time.monotonic()
        completes(target)  # others are served meanwhile
        answer = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            answer += chunk
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert openai_error(answer.partition(b"\r\n\r\n")[2])["code"] == "body_timeout"
    assert waited < BODY_TIMEOUT_S + 5
    completes(target)


def test_half_open_slow_and_abandoned_connections_leave_the_server_serving(target):
    auth = f"Authorization: Bearer {target.key}\r\n".encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n" % len(body(OK_COMPLETION)) + body(OK_COMPLETION)
    )
    sockets = []
    try:
        # Headers never finished (uvicorn times no request out before its headers are in: these
        # wait, and must not hold up anyone else).
        for _ in range(5):
            s = socket.create_connection((target.host, target.port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            sockets.append(s)
        # Half the body, then gone.
        with socket.create_connection((target.host, target.port), timeout=10) as s:
            s.sendall(request[: len(request) - 10])
        # The whole request, then the write side shut (half-open): answered or closed, never
        # a hang.
        with socket.create_connection((target.host, target.port), timeout=10) as s:
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            answer = s.recv(65536)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 "), answer[:200]
        # Two requests in one write (pipelined): both answered, in order.
        last = request.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
        answer = exchange(target, request + last)
        assert answer.count(b"HTTP/1.1 200 ") == 2, answer[:400]
        completes(target)
    finally:
        for s in sockets:
            s.close()
    completes(target)


def test_many_connections_at_once(target):
    """200 idle connections and 40 bad requests at the same time: every bad request gets its
    400, and a normal request is answered while the idle ones are still open."""
    idle = [socket.create_connection((target.host, target.port), timeout=10) for _ in range(200)]
    try:
        results: list[int] = []
        lock = threading.Lock()

        def bad() -> None:
            headers = target.auth() | {"Content-Type": "application/json"}
            with target.connection() as conn:
                status, _, _ = send(conn, "POST", COMPLETIONS, b'{"prompt": "\\ud800"}', headers)
            with lock:
                results.append(status)

        threads = [threading.Thread(target=bad) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == [400] * 40
        completes(target)
    finally:
        for s in idle:
            s.close()
    completes(target)
