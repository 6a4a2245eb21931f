"""Backend kinds: what each engine's answers about itself say, the load read from each one's
exposition as Prometheus reads it, and how a stream of each is continued."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from poise.gateway.backend_kind import TRAITS, detect
from poise.gateway.continuation import Transcript, continuable, continued_body
from poise.gateway.load_report import parse_metrics, parse_slots

# What each engine answers (from their documentation and, for vLLM, a running vLLM 0.32).
ANSWERS: dict[str, dict[str, Any]] = {
    "poise": {"/version": {"version": "0.1.0", "engine": "poise", "model": "m"}},
    "vllm": {"/version": {"version": "0.32.0"}},
    "sglang": {
        "/version": {"version": "0.5.0"},
        "/get_server_info": {"model_path": "qwen/qwen2.5-0.5b-instruct", "version": "0.5.0"},
    },
    "llamacpp": {
        "/props": {"build_info": "b8681", "total_slots": 4, "default_generation_settings": {}},
    },
    "tgi": {"/info": {"model_id": "m", "router": "text-generation-router", "version": "3.0"}},
    "openai": {"/v1/models": {"object": "list", "data": []}},  # says nothing of itself
}


def _transport(answers: dict[str, Any]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path in answers:
            return httpx.Response(200, json=answers[request.url.path])
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handle)


@pytest.mark.parametrize("kind", list(ANSWERS))
async def test_each_kind_is_detected_from_what_it_says_of_itself(kind):
    async with httpx.AsyncClient(transport=_transport(ANSWERS[kind])) as client:
        assert await detect(client, "http://b", {}, 1.0) == kind


async def test_a_backend_that_does_not_answer_is_not_detected_yet():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        assert await detect(client, "http://b", {}, 1.0) is None


async def test_a_server_that_answers_no_success_is_not_detected_yet():
    """A proxy's 502 or a server still starting is asked again, not taken for a kind."""
    bad = httpx.MockTransport(lambda request: httpx.Response(502, text="bad gateway"))
    async with httpx.AsyncClient(transport=bad) as client:
        assert await detect(client, "http://b", {}, 1.0) is None


async def test_a_poise_gateway_in_front_is_no_engine():
    answers = {"/version": {"version": "0.1.0", "role": "gateway"}}
    async with httpx.AsyncClient(transport=_transport(answers)) as client:
        assert await detect(client, "http://b", {}, 1.0) == "openai"


# vLLM's exposition as it serves it, with what a hand-written regex got wrong: a sample
# timestamp, a label value holding a brace and a space, a model per label set to sum.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0 1733356800000
vllm:num_requests_running{engine="1",model_name="a {b} c"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0
"""

SGLANG_METRICS = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 5.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 7.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 10.0
"""

LLAMACPP_METRICS = """\
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 6
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 42
"""

TGI_METRICS = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 3
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 8
"""

OPENMETRICS = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 5.0 # {trace_id="abc"} 1.0 1733356800.0
# EOF
"""


@pytest.mark.parametrize(
    ("kind", "text", "expected"),
    [
        ("vllm", VLLM_METRICS, (4.0, 5.0, 0.25, 1234.0)),
        ("poise", VLLM_METRICS, (4.0, 5.0, 0.25, 1234.0)),
        ("sglang", SGLANG_METRICS, (7.0, 5.0, 0.5, 10.0)),
        ("llamacpp", LLAMACPP_METRICS, (6.0, 2.0, 0.0, 42.0)),
        ("tgi", TGI_METRICS, (3.0, 8.0, 0.0, None)),
    ],
)
def test_load_is_read_by_each_engine_s_own_names(kind, text, expected):
    report = parse_metrics(text, TRAITS[kind])
    assert report is not None
    assert (report.waiting, report.running, report.kv_usage, report.processed) == expected


def test_another_engine_s_names_are_not_read_as_load():
    report = parse_metrics(SGLANG_METRICS, TRAITS["vllm"])
    assert report is not None and (report.waiting, report.running) == (0.0, 0.0)


def test_openmetrics_with_exemplars_is_read_as_openmetrics():
    report = parse_metrics(OPENMETRICS, TRAITS["vllm"], "application/openmetrics-text")
    assert report is not None and (report.waiting, report.processed) == (2.0, 5.0)


def test_kv_usage_is_the_fullest_engine_s_under_one_name():
    """Two engines at 60 % are not 120 %; the deprecated name beside the current one is the
    same fraction said twice."""
    text = """\
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.6
vllm:prompt_tokens_total{engine="0",model_name="m"} 10
vllm:generation_tokens_total{engine="0",model_name="m"} 5
"""
    report = parse_metrics(text, TRAITS["vllm"])
    assert report is not None and report.kv_usage == 0.6 and report.processed == 15.0


def test_an_exposition_that_does_not_parse_is_no_report():
    assert parse_metrics("vllm:num_requests_waiting{oops 3\n", TRAITS["vllm"]) is None


def test_llama_server_slots_count_the_running_requests():
    slots = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}, "junk"]
    report = parse_slots(slots)
    assert report is not None and report.running == 1.0
    assert parse_slots({"error": "slots disabled"}) is None


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _chat_chunk(content: str | None = None, role: str | None = None, rid: str = "c1") -> bytes:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "finish_reason": None}
    return _event({"id": rid, "created": 5, "model": "m", "choices": [choice]})


def test_a_chat_transcript_continues_as_one_stream():
    t = Transcript(chat=True, strip_usage=True)
    for e in (_chat_chunk("", role="assistant"), _chat_chunk("Hel"), _chat_chunk("lo")):
        assert t.observe(e) == e  # passed as they came
    assert (t.text, t.events, t.id) == ("Hello", 2, "c1")
    t.resumed()
    # The continuation's opening role chunk is dropped; its events take the stream's identity.
    assert t.observe(_chat_chunk("", role="assistant", rid="other")) == b""
    out = json.loads(t.observe(_chat_chunk(" there", rid="other"))[6:])
    assert out["id"] == "c1" and out["created"] == 5 and out["poise_resumed"] == "approximate"
    assert t.text == "Hello there"
    # The usage the gateway asked for: taken, not passed on; the text sent before counts as
    # output, not prompt.
    usage = {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}
    assert t.observe(_event({"id": "other", "choices": [], "usage": usage})) == b""
    assert t.usage == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert t.used_tokens() == 13


def test_a_usage_chunk_the_client_asked_for_passes():
    t = Transcript(chat=False, strip_usage=False)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    e = _event({"id": "x", "choices": [], "usage": usage})
    assert t.observe(e) == e and t.used_tokens() == 5


def test_tool_calls_or_reasoning_make_a_stream_not_continuable():
    for delta in ({"tool_calls": [{"index": 0}]}, {"reasoning_content": "hmm"}):
        t = Transcript(chat=True, strip_usage=True)
        t.observe(_event({"id": "c", "choices": [{"index": 0, "delta": delta}]}))
        assert not t.continuable


def test_a_completion_continues_from_its_prompt_and_the_text_sent():
    data = {"model": "m", "prompt": "Once", "max_tokens": 10, "stream": True}
    t = Transcript(chat=False, strip_usage=True)
    for text in (" upon", " a"):
        t.observe(_event({"id": "x", "choices": [{"index": 0, "text": text}]}))
    for kind in ("vllm", "tgi", "openai", "llamacpp", "sglang", "poise"):
        body = continued_body(data, "/v1/completions", t, kind)
        assert body is not None and body["prompt"] == "Once upon a" and body["max_tokens"] == 8


def test_a_chat_continues_where_the_engine_can_continue_a_message():
    data = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    t = Transcript(chat=True, strip_usage=True)
    t.observe(_chat_chunk("Sure"))
    final = {"role": "assistant", "content": "Sure"}
    for kind in ("vllm", "sglang", "poise"):
        body = continued_body(data, "/v1/chat/completions", t, kind)
        assert body is not None and body["messages"][-1] == final
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
        assert body["max_tokens"] == 4
    prefilled = continued_body(data, "/v1/chat/completions", t, "llamacpp")
    assert prefilled is not None and prefilled["messages"][-1] == final
    assert "continue_final_message" not in prefilled
    assert continued_body(data, "/v1/chat/completions", t, "tgi") is None
    assert continued_body(data, "/v1/chat/completions", t, "openai") is None
    # Nothing sent yet: the same request again, on any engine.
    empty = Transcript(chat=True, strip_usage=True)
    assert continued_body(data, "/v1/chat/completions", empty, "tgi") == data


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 2},
        {"logprobs": True},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"response_format": {"type": "json_object"}},
        {"suffix": "end"},
    ],
)
def test_what_text_cannot_carry_on_is_not_continued(extra):
    data = {"model": "m", "prompt": "p", **extra}
    assert not continuable("/v1/completions", data)
    t = Transcript(chat=False, strip_usage=True, continuable=False)
    t.observe(_event({"id": "x", "choices": [{"index": 0, "text": "t"}]}))
    assert continued_body(data, "/v1/completions", t, "vllm") is None
    assert continuable("/v1/completions", {"model": "m", "prompt": "p"})
    assert continuable("/v1/completions", {"prompt": "p", "response_format": {"type": "text"}})
