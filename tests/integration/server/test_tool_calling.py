"""Tool calling against a real replica of a random-weight model, with the openai client.

``required`` and a named function are forced by structured output against the tools' schemas,
so even this model's calls parse and validate; ``auto`` reads the model's own format (here
Hermes, named by the server's flag), and a random model's free text stays content.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from serverproc import ServerProcess

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Lima", "Pune"]},
        "unit": {"type": "string", "enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    proc = ServerProcess(
        llama_dir,
        tmp_path_factory.mktemp("logs"),
        "--max-model-len",
        "1024",
        "--tool-call-parser",
        "hermes",
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_calls_parse_and_validate_whole_and_streamed(client, temperature):
    kwargs = dict(
        model="m",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        # One call: a list of calls ends when the model ends it, and a random model may not
        # before max_tokens (the list's items are forced; its length is the model's choice).
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=temperature,
        seed=11,
    )
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _check_calls(choice.message.tool_calls)
    # The openai package's own stream accumulator folds the deltas into the same calls.
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    _check_calls(streamed.message.tool_calls)
    # Seeded, so sampled answers agree too; ids derive from each response's own id.
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_required_as_it_comes_gives_valid_calls_even_from_a_random_model(client):
    """The issue's call as written: parallel calls allowed, so the forced list is bounded
    (MAX_PARALLEL_CALLS) and a model that would list calls forever still ends it."""
    r = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=900,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert 1 <= len(choice.message.tool_calls) <= 8
    _check_calls(choice.message.tool_calls)


def test_without_parallel_calls_required_gives_exactly_one_in_each_choice(client):
    r = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=1.0,
        seed=5,
        n=3,
    )
    for choice in r.choices:
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)


def test_a_named_function_is_called_with_valid_arguments_streamed_too(client):
    kwargs = dict(
        model="m",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=100,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs)
    calls = whole.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"]
    _check_calls(calls)
    assert whole.choices[0].finish_reason == "stop"  # as OpenAI answers a forced function
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_tool_results_go_back_into_the_conversation(client):
    r = client.chat.completions.create(
        model="m",
        messages=[
            *MESSAGES,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city":"Oslo","days":1}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C and rain"},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content


def test_auto_reads_the_models_own_format_and_free_text_stays_content(client):
    r = client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_tool_requests_that_cannot_be_honoured_are_400s(server, body, param):
    payload = {"model": "m", "messages": MESSAGES, "tools": TOOLS, **body}
    if payload["tools"] is None:
        del payload["tools"]
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
