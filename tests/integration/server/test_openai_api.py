"""The replica's OpenAI API, driven by the official openai client against a real process."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from poise.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(llama_dir) -> Tokenizer:
    return Tokenizer(llama_dir)


def test_completion_text_usage_and_length(client, tokenizer):
    prompt = "The import system"
    r = client.completions.create(model="m", prompt=prompt, max_tokens=7, temperature=0)
    assert r.object == "text_completion" and r.model == "m"
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert choice.text


def test_streamed_completion_matches_the_unstreamed_one(client):
    kwargs = dict(model="m", prompt="A function definition", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])


def test_chat_streamed_and_not(client, tokenizer):
    messages = [{"role": "user", "content": "Tell me about exceptions"}]
    whole = client.chat.completions.create(
        model="m", messages=messages, max_tokens=10, temperature=0
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10
    prompt = tokenizer.apply_chat_template(messages)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    stream = client.chat.completions.create(
        model="m", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_with_reason_stop(client):
    base = (
        client.completions.create(
            model="m", prompt="The for statement", max_tokens=16, temperature=0
        )
        .choices[0]
        .text
    )
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    assert stop.strip(), base
    r = client.completions.create(
        model="m", prompt="The for statement", max_tokens=16, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(stop)]


def test_n_choices_with_a_seed_differ_and_reproduce(client):
    kwargs = dict(model="m", prompt="Classes", max_tokens=8, temperature=1.0, n=3, seed=11)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1
    assert a.usage.completion_tokens == 24


def test_seeded_chat_reproduces(client):
    kwargs = dict(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0.9,
        top_p=0.95,
        seed=5,
    )
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


def test_token_id_prompts_and_logprobs(client, tokenizer):
    ids = tokenizer.encode("The with statement")
    by_text = client.completions.create(
        model="m", prompt="The with statement", max_tokens=5, temperature=0, logprobs=2
    )
    by_ids = client.completions.create(
        model="m", prompt=ids, max_tokens=5, temperature=0, logprobs=2
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    lp = by_ids.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_models_version_health_ready(server, client):
    assert [m.id for m in client.models.list().data] == ["m"]
    assert httpx.get(server.url + "/version").json()["model"] == "m"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/ready").status_code == 200
    probe = httpx.get(server.url + "/health", params={"probe": "generate"})
    assert probe.status_code == 200 and "generated one token" in probe.json()["reason"]
    metrics = httpx.get(server.url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:request_success_total",
        "vllm:prefix_cache_queries_total",
        "poise_engine_healthy",
    ):
        assert name in metrics


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 9}, "presence_penalty"),
        ({"n": 0}, "n"),
        ({"logprobs": 99}, "logprobs"),
        ({"max_tokens": 10_000}, "max_tokens"),
    ],
)
def test_invalid_parameters_are_400_never_422(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="hi", **kwargs)
    assert info.value.status_code == 400
    assert _error(info.value)["param"] == param


def test_too_long_prompt_says_the_limits(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="word " * 2000, max_tokens=4)
    message = _error(info.value)["message"]
    assert "256" in message and "tokens" in message


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi")
    assert _error(info.value)["code"] == "model_not_found"


def test_malformed_bodies_are_400(server):
    for body in (b"{not json", b"[]", b'{"prompt": 5}', b'{"messages": []}'):
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = httpx.post(
                server.url + path, content=body, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, (path, body, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_oversized_body_is_413(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * (5 << 20)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_bad_deadline_and_priority_headers_are_400(server):
    for headers in ({"X-Request-Deadline-Ms": "soon"}, {"X-Priority": "high"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 400, r.text


def test_bad_input_changes_nothing(server, client):
    queries = server.metric("vllm:prefix_cache_queries_total")
    for bad in ({"temperature": -3}, {"max_tokens": 5000}, {"stop_token_ids": [-1]}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="m", prompt="hi", extra_body=bad)
    assert server.metric("vllm:prefix_cache_queries_total") == queries  # never reached the engine
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    text = httpx.get(server.url + "/metrics", timeout=5).text
    assert "\npoise_kv_cache_room_waits_total{" in text  # exported, and nobody was held
    assert server.metric("poise_kv_cache_room_waits_total") == 0


def test_one_json_log_line_per_request_with_timings_and_no_text(server):
    body = {"prompt": "a private prompt", "max_tokens": 3, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(
        server.url + "/v1/completions", json=body, headers={"x-request-id": "rid-42"}, timeout=60
    )
    plain_seen_ms = 1000 * (time.perf_counter() - t0)
    assert r.status_code == 200
    streamed = {**body, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=streamed, headers={"x-request-id": "rid-43"}
    ) as s:
        s.read()
    stream_seen_ms = 1000 * (time.perf_counter() - t0)
    bad = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": -1})
    assert bad.status_code == 400

    def lines() -> list[dict]:
        text = server.log_path.read_text(errors="replace")
        out = []
        for line in text.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == "request":
                    out.append(record)
        return out

    got = {x["request_id"]: x for x in lines()}
    plain, stream = got["rid-42"], got["rid-43"]
    assert plain["status"] == 200 and plain["output_tokens"] == 3 and not plain["stream"]
    assert plain["finish_reasons"] == ["length"] and plain["prompt_tokens"] > 0
    assert stream["stream"] and stream["status"] == 200 and stream["output_tokens"] == 3
    # The first of 3 tokens comes after a prefill and before the 2 decode steps that follow it,
    # and the server's whole duration lies within the round trip its client timed.
    for record, seen_ms in ((plain, plain_seen_ms), (stream, stream_seen_ms)):
        assert record["queue_ms"] <= record["ttft_ms"], record
        assert 0 < record["ttft_ms"] < record["duration_ms"] <= seen_ms, (record, seen_ms)
    assert any(x["status"] == 400 for x in got.values())
    assert "a private prompt" not in server.log_path.read_text(errors="replace")


def test_a_chat_template_of_the_requests_own_needs_the_servers_trust(client):
    """A template is code run on the server: by default a request may only name the model's."""
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=1,
            extra_body={"chat_template": "{% for i in range(10**9) %}{% endfor %}"},
        )
    assert _error(info.value)["param"] == "chat_template"
    assert client.chat.completions.create(model="m", messages=messages, max_tokens=1).choices


def test_chat_echo_starts_the_answer_with_the_message_it_continues(client):
    kw = dict(
        model="m",
        messages=[
            {"role": "user", "content": "Tell a story"},
            {"role": "assistant", "content": "Once upon a time"},
        ],
        max_tokens=6,
        temperature=0,
    )
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**kw, extra_body=cont).choices[0].message.content
    echoed = client.chat.completions.create(**kw, extra_body={**cont, "echo": True})
    assert echoed.choices[0].message.content == "Once upon a time" + plain
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.chat.completions.create(**kw, stream=True, extra_body={**cont, "echo": True})


def test_the_user_field_is_logged_with_its_request(client, server):
    client.completions.create(model="m", prompt="hi", max_tokens=1, user="end-user-4711")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "end-user-4711" not in server.log():
        time.sleep(0.1)
    line = next(json.loads(x) for x in server.log().splitlines() if "end-user-4711" in x)
    assert line["user"] == "end-user-4711" and line["path"] == "/v1/completions"
