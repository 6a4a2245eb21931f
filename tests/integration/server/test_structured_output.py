"""Structured output against a real replica of a random-weight model, with the openai client.

A random model writes anything; every answer here still parses and validates, because the
grammar decides which tokens it may draw. ``max_tokens`` is ample for the schemas, whose strings
and arrays are bounded (an unbounded string may go on until ``max_tokens`` and be cut).
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from poise.protocol import STREAM_TOKENS_HEADER, parse_token_note
from serverproc import ServerProcess

MAX_TOKENS = 400

SCHEMAS: dict[str, dict] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "any_of_and_numbers": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": -5, "maximum": 5},
                    {"type": "string", "maxLength": 6},
                    {"type": "boolean"},
                ]
            },
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["value", "ratio"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "kind": {"type": "string", "enum": ["a", "b"]},
            "note": {"type": "string", "maxLength": 10},
            "count": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["kind"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    proc = ServerProcess(llama_dir, tmp_path_factory.mktemp("logs"), "--max-model-len", "1024")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _texts_streamed(stream, n: int) -> list[str]:
    texts = [""] * n
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    return texts


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_validates_against_its_schema(client, name, temperature):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    kwargs = dict(
        model="m",
        messages=[{"role": "user", "content": "Give me the JSON."}],
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        seed=7,
        n=3,
        response_format=fmt,
    )
    whole = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in whole.choices]
    assert all(c.finish_reason == "stop" for c in whole.choices)
    texts += _texts_streamed(client.chat.completions.create(stream=True, **kwargs), 3)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    if temperature == 0.0:  # greedy: streamed and whole agree
        assert texts[:3] == texts[3:]


class Pet(BaseModel):
    species: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)


def test_the_openai_parse_helper_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model="m",
        messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet,
        max_tokens=MAX_TOKENS,
        temperature=0.9,
        seed=3,
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet)
    assert 0 <= pet.age <= 30


def test_json_object_and_the_completions_route(client):
    r = client.completions.create(
        model="m",
        prompt="JSON:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    # Any object: a random model may write a long one, so only a finished one must parse.
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].text.startswith("{")


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        (
            {"guided_grammar": 'start: "x" ("+" "x")*  ";"'},
            lambda t: t.endswith(";") and set(t[:-1]) <= {"x", "+"},
        ),
        (
            {"structured_outputs": {"choice": ["left", "right"]}},
            lambda t: t in ("left", "right"),
        ),
        (
            {
                "guided_json": {
                    "type": "object",
                    "properties": {"a": {"type": "boolean"}},
                    "required": ["a"],
                    "additionalProperties": False,
                }
            },
            lambda t: json.loads(t) in ({"a": True}, {"a": False}),
        ),
    ],
)
def test_vllms_guided_extras(client, extra, check):
    for temperature in (0.0, 1.0):
        r = client.completions.create(
            model="m",
            prompt="Answer:",
            max_tokens=60,
            temperature=temperature,
            seed=1,
            extra_body=extra,
        )
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop", text
        assert check(text), text


def test_stop_strings_still_cut_a_constrained_answer(client):
    r = client.completions.create(
        model="m",
        prompt="Answer:",
        max_tokens=60,
        temperature=0,
        stop=["-"],
        extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].text) == 3 and r.choices[0].text.isdigit()


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_json": {"type": "object"}, "min_tokens": 2}, "min_tokens"),
        (
            {"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
            "response_format.json_schema",
        ),
        ({"guided_choice": ["a", "b"], "ignore_eos": True}, "ignore_eos"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "description": "d"},
                }
            },
            "response_format.json_schema.description",
        ),
        ({"guided_choice": ["a", "b"], "logit_bias": {"5": 3}}, "logit_bias"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        # Tools with the default tool_choice "auto", and no tool-call format known: told so.
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ],
)
def test_a_constraint_that_cannot_be_honoured_is_a_400_naming_it(server, body, param):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_logit_bias_is_honoured(client, server):
    prompt = "Once upon"
    free = client.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0)
    first = _first_token(server, prompt)
    # Banning the greedy first token changes the answer; favouring one forces it.
    banned = client.completions.create(
        model="m", prompt=prompt, max_tokens=5, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != free.choices[0].text
    assert _first_token(server, prompt, {str(first): -100}) != first
    forced = client.completions.create(
        model="m", prompt=prompt, max_tokens=3, temperature=0, logit_bias={"65": 100}
    )
    detok = httpx.post(
        server.url + "/detokenize", json={"model": "m", "tokens": [65, 65, 65]}, timeout=10
    ).json()["prompt"]
    assert forced.choices[0].text == detok
    bad = httpx.post(
        server.url + "/v1/completions",
        json={"model": "m", "prompt": "x", "logit_bias": {"999999": 1}},
        timeout=10,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def _first_token(server, prompt: str, bias: dict | None = None) -> int:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    if bias:
        body["logit_bias"] = bias
    _, notes = _stream_events(server.url + "/v1/completions", body, {STREAM_TOKENS_HEADER: "1"})
    return next(t for ids, _ in notes for t in ids)


def _stream_events(url: str, body: dict, headers: dict | None = None) -> tuple[str, list]:
    """The streamed content, and the token notes (ids, characters sent) in order."""
    text, notes = "", []
    with httpx.stream("POST", url, json=body, headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(": poise-tokens "):
                notes.append(parse_token_note(line.encode()))
            elif line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or "" if "delta" in c else c["text"]
    return text, notes


def test_a_resumed_constrained_stream_continues_the_same_grammar(server):
    """Mid-stream migration: the matcher is rebuilt from the tokens already produced."""
    schema = SCHEMAS["array_bounds"]
    url = server.url + "/v1/chat/completions"
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "tags"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "guided_json": schema,
    }
    whole, notes = _stream_events(url, body, {STREAM_TOKENS_HEADER: "1"})
    ids = [t for note_ids, _ in notes[:5] for t in note_ids]
    chars = notes[4][1]
    assert 0 < chars < len(whole)
    rest, _ = _stream_events(url, {**body, "poise_resume": {"token_ids": ids, "text_chars": chars}})
    assert whole[:chars] + rest == whole
    jsonschema.validate(json.loads(whole), schema)


def _ref_chain(links: int) -> dict:
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(links)
    }
    defs[f"d{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize(
    "extra, param",
    [
        # A thousand $ref links overflowed the grammar compiler's stack: SIGSEGV, server gone.
        ({"guided_json": _ref_chain(1000)}, "guided_json"),
        (
            {
                "guided_grammar": "start: r0\n"
                + "".join(f"r{i}: r{i + 1}\n" for i in range(5000))
                + 'r5000: "a"\n'
            },
            "guided_grammar",
        ),
        # Valid, but its first mask takes seconds to build.
        ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
    ],
)
def test_a_constraint_that_would_crash_or_stall_the_engine_is_a_400(server, extra, param):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "m", "prompt": "x", "max_tokens": 5, **extra},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert len(r.json()["error"]["message"]) < 500
    assert server.proc.poll() is None
    ok = httpx.post(
        server.url + "/v1/completions",
        json={"model": "m", "prompt": "x", "max_tokens": 5, "guided_choice": ["yes", "no"]},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no")


def test_logprobs_of_a_constrained_answer_are_finite_json(server):
    """Tokens the grammar bans have logprob -inf: clamped (as vLLM's), since JSON has none."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "yes or no?"}],
        "logprobs": True,
        "top_logprobs": 5,
        "guided_choice": ["yes", "no"],
        "max_tokens": 10,
    }
    for stream in (False, True):
        r = httpx.post(
            server.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60
        )
        assert r.status_code == 200, r.text
        assert "Infinity" not in r.text and "NaN" not in r.text
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    entries = whole["choices"][0]["logprobs"]["content"]
    assert entries and all(
        -9999.0 <= alt["logprob"] <= 0 for e in entries for alt in e["top_logprobs"]
    )
