"""The request models' own bounds: stop sequences as OpenAI bounds them, and a top-level field
poise does not know is refused, not ignored."""

import pytest
from pydantic import ValidationError

from poise.protocol import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    ChatCompletionRequest,
    CompletionRequest,
    stop_problem,
)


def errors(model: type, **body: object) -> list[dict]:
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    return err.value.errors()


def test_stop_sequences_are_bounded_in_number_and_length():
    ok = ["s" * MAX_STOP_CHARS] * MAX_STOP_SEQUENCES
    assert CompletionRequest(prompt="x", stop=ok).stop == ok
    assert stop_problem(ok) is None and stop_problem(None) is None and stop_problem(5) is None
    many = errors(CompletionRequest, prompt="x", stop=[f"s{i}" for i in range(10_000)])
    assert many[0]["loc"] == ("stop",) and "at most 4 stop sequences" in many[0]["msg"]
    long = errors(ChatCompletionRequest, messages=[{"role": "user"}], stop="s" * 10_000)
    assert long[0]["loc"] == ("stop",) and "at most 256 characters" in long[0]["msg"]
    # Counted before the types are checked: 10,000 non-strings are refused for their number.
    assert "at most 4" in errors(CompletionRequest, prompt="x", stop=list(range(10_000)))[0]["msg"]


def test_stop_token_ids_are_bounded():
    assert CompletionRequest(prompt="x", stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    err = errors(CompletionRequest, prompt="x", stop_token_ids=list(range(10_000)))
    assert err[0]["loc"] == ("stop_token_ids",)


# OpenAI's request fields poise does not implement, one of each family (deprecated function
# calling, audio and modalities, predicted outputs, web search, storage and metadata, service
# tiers, reasoning), and one no API has.
UNHONOURED = [
    "foo",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "store",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "verbosity",
]


@pytest.mark.parametrize("field", UNHONOURED)
def test_a_top_level_field_poise_does_not_honour_is_refused(field):
    for model, body in (
        (CompletionRequest, {"prompt": "x"}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        err = errors(model, **body, **{field: {"a": 1}})
        assert err[0]["type"] == "extra_forbidden" and err[0]["loc"] == (field,)
    err = errors(CompletionRequest, prompt="x", stream_options={"include_usage": 1, "x": 1})
    assert err[0]["loc"] == ("stream_options", "x")


def test_tool_fields_belong_to_chat_only():
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        err = errors(CompletionRequest, prompt="x", **{field: "auto"})
        assert err[0]["type"] == "extra_forbidden" and err[0]["loc"] == (field,)


def test_messages_may_carry_fields_of_an_answer_sent_back():
    # The OpenAI SDK sends an earlier answer's message back with refusal, annotations, audio.
    message = {"role": "assistant", "content": "hi", "refusal": None, "annotations": []}
    body = ChatCompletionRequest(messages=[message, {"role": "user", "content": "and?"}])
    assert body.messages[0].template_dict() == {"role": "assistant", "content": "hi"}
