"""Tool-call parsing and streaming: every family's format, whole and streamed in any pieces."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.protocol import ChatCompletionRequest
from poise.server.tool_calls import ToolPlan, ToolStream, plan_tools, shape_message
from poise.server.tool_parsers import detect_parser, parse_hermes, parse_llama3_json, parse_mistral

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]


def _body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, **kw)


def test_hermes_calls_and_content():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    parsed = parse_hermes(text)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("add", {"a": 1, "b": 2}),
    ]


def test_a_malformed_call_is_content_never_half_a_call():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
    assert parse_hermes(text).calls == [] and parse_hermes(text).content == text
    assert parse_llama3_json('{"name": 3}').calls == []
    assert parse_mistral("[TOOL_CALLS] not json").calls == []


def test_llama3_and_mistral_formats():
    llama = (
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
        '{"name": "add", "parameters": {"a": 2}}'
    )
    assert [json.loads(c.arguments)["a"] for c in parse_llama3_json(llama).calls] == [1, 2]
    assert parse_llama3_json("The answer is {not a call}").calls == []
    mistral = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert parse_mistral(mistral).calls[0].name == "get_weather"


def test_the_parser_follows_the_chat_templates_format():
    assert detect_parser("... <tool_call> ...") == "hermes"
    assert detect_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_parser("<|python_tag|>") == "llama3_json"
    assert detect_parser("{{ message['content'] }}") is None


def test_plans_and_the_400s_for_what_cannot_be_honoured():
    assert plan_tools(_body(), "hermes", None).mode == "auto"  # type: ignore[union-attr]
    with pytest.raises(Exception, match="tool-call-parser"):
        plan_tools(_body(), None, "{{ message['content'] }}")
    named = plan_tools(
        _body(tool_choice={"type": "function", "function": {"name": "add"}}), None, None
    )
    assert named is not None and named.mode == "named" and named.name == "add"
    with pytest.raises(Exception, match="not among the tools"):
        plan_tools(
            _body(tool_choice={"type": "function", "function": {"name": "nope"}}), None, None
        )
    with pytest.raises(Exception, match="needs tools"):
        plan_tools(
            ChatCompletionRequest(
                messages=[{"role": "user", "content": "x"}], tool_choice="required"
            ),
            None,
            None,
        )


def _streamed(plan: ToolPlan, pieces: list[str], with_specials: str) -> tuple[dict, str | None]:
    """The deltas of a stream, folded as the openai client's accumulator folds them."""
    stream = ToolStream(plan, "chatcmpl-1", 0)
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece, [])
    more, reason = stream.finish(with_specials, "stop")
    deltas += more
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"function": {"arguments": ""}})
            for key in ("id", "type"):
                if key in tc:
                    call[key] = tc[key]
            fn = tc.get("function", {})
            if "name" in fn:
                call["function"]["name"] = fn["name"]
            call["function"]["arguments"] += fn.get("arguments", "")
    message = {"content": content or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message, reason


ANSWERS = {
    "auto": 'Sure.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
    "required": '[{"name":"add","parameters":{"a":1}},{"name":"get_weather","parameters":{}}]',
    "named": '{"a":1,"b":[2,3]}',
    "none": "just words <tool_call> as text",
}


@pytest.mark.parametrize("mode", sorted(ANSWERS))
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
@settings(max_examples=40, deadline=None)
def test_streamed_deltas_reassemble_into_the_whole_answers_calls(mode, cuts):
    plan = plan_tools(
        _body(
            tool_choice={"type": "function", "function": {"name": "add"}}
            if mode == "named"
            else mode
        ),
        "hermes",
        None,
    )
    assert plan is not None
    text = ANSWERS[mode]
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    whole, whole_reason = shape_message(plan, "chatcmpl-1", 0, text, text, "stop")
    streamed, reason = _streamed(plan, pieces, text)
    assert streamed.get("tool_calls") == whole.get("tool_calls")
    assert reason == whole_reason
    if mode == "none":
        assert streamed["content"] == whole["content"] == text
    if mode in ("auto", "required"):
        assert reason == "tool_calls"
    if mode == "named":
        assert reason == "stop"  # as OpenAI answers a forced function
        assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": [2, 3]}


def test_a_resumed_stream_primed_with_what_was_sent_goes_on_identically():
    plan = plan_tools(_body(), "hermes", None)
    assert plan is not None
    text = 'Thinking about it<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    for cut in range(len(text) + 1):
        first = ToolStream(plan, "id", 0)
        sent = first.feed(text[:cut], [])
        second = ToolStream(plan, "id", 0)
        second.feed(text[:cut], [])  # primed, its output dropped: the client has it
        rest = second.feed(text[cut:], [])
        rest += second.finish(text, "stop")[0]
        again = ToolStream(plan, "id", 0)
        once = again.feed(text, []) + again.finish(text, "stop")[0]
        joined = "".join(d.get("content") or "" for d in sent + rest)
        assert joined == "".join(d.get("content") or "" for d in once)
        assert [d for d in rest if "tool_calls" in d] == [d for d in once if "tool_calls" in d]


def _official_accumulation(plan: ToolPlan, pieces: list[str], text: str):
    """The stream's chunks folded by the openai package's own accumulator."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def push(delta: dict, reason: str | None = None) -> None:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        state.handle_chunk(ChatCompletionChunk.model_validate({**head, "choices": [choice]}))

    push({"role": "assistant", "content": ""})
    stream = ToolStream(plan, "chatcmpl-1", 0)
    for piece in pieces:
        for delta in stream.feed(piece, []):
            push(delta)
    deltas, reason = stream.finish(text, "stop")
    for delta in deltas[:-1]:
        push(delta)
    push(deltas[-1] if deltas else {}, reason)
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_the_openai_accumulator_folds_the_stream_into_the_whole_answers_calls(mode):
    choice = {"type": "function", "function": {"name": "add"}} if mode == "named" else mode
    plan = plan_tools(_body(tool_choice=choice), "hermes", None)
    assert plan is not None
    text = ANSWERS[mode]
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    whole, reason = shape_message(plan, "chatcmpl-1", 0, text, text, "stop")
    folded = _official_accumulation(plan, pieces, text)
    assert folded.finish_reason == reason
    got = [(c.id, c.function.name, c.function.arguments) for c in folded.message.tool_calls]
    want = [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
    ]
    assert got == want


def test_json_that_is_no_call_and_calls_of_functions_not_offered_stay_content():
    assert parse_llama3_json('{"name": "Bob", "age": 3}').calls == []
    plan = plan_tools(_body(), "hermes", None)
    assert plan is not None
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    message, reason = shape_message(plan, "id", 0, text, text, "stop")
    assert message["content"] == text and "tool_calls" not in message and reason == "stop"


def test_tool_call_arguments_reach_the_template_as_objects_not_text_again():
    message = ChatCompletionRequest(
        messages=[
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1}'},
                    },
                    {
                        "id": "d",
                        "type": "function",
                        "function": {"name": "add", "arguments": "not json"},
                    },
                ],
            }
        ]
    ).messages[0]
    calls = message.template_dict()["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"a": 1}
    assert calls[1]["function"]["arguments"] == "not json"


def test_a_marker_that_is_a_special_token_holds_the_stream_by_its_id():
    """Hermes' <tool_call> is a special token in some vocabularies: the detokenizer drops it
    from the streamed text, so the raw call would stream as content."""
    plan = plan_tools(_body(), "hermes", None)
    assert plan is not None
    stream = ToolStream(plan, "id", 0, marker_token=77)
    assert stream.feed("Sure. ", [5, 6]) == [{"content": "Sure. "}]
    assert stream.feed('{"name": "add", "arguments": {}}', [77, 8, 9]) == []
    with_specials = 'Sure. <tool_call>{"name": "add", "arguments": {}}</tool_call>'
    deltas, reason = stream.finish(with_specials, "stop")
    assert reason == "tool_calls" and not any("content" in d for d in deltas)


def test_auto_holds_a_strict_tools_calls_to_its_schema():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "strict": True,
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["a"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools)
    plan = plan_tools(body, "hermes", None)
    assert plan is not None
    good = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    bad = '<tool_call>{"name": "add", "arguments": {"a": "one"}}</tool_call>'
    assert shape_message(plan, "id", 0, good, good, "stop")[1] == "tool_calls"
    message, reason = shape_message(plan, "id", 0, bad, bad, "stop")
    assert reason == "stop" and "tool_calls" not in message and message["content"] == bad
