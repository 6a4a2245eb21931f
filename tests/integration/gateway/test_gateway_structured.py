"""Structured output and tool calls through the gateway, and through a replica's kill -9."""

from __future__ import annotations

import json
import os
import signal
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from gatewayproc import backends, gateways_before
from serverproc import start_servers

FAST_HEALTH = {"interval_s": 0.5, "timeout_s": 2.0, "healthy_after": 1, "unhealthy_after": 1}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99},
        "note": {"type": "string", "maxLength": 40},
    },
    "required": ["a", "b", "note"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]


class Pet(BaseModel):
    species: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)


@pytest.fixture
def gateway(healthy_pair, tmp_path):
    with gateways_before(healthy_pair, tmp_path, FAST_HEALTH) as start:
        yield start


def test_the_openai_helpers_work_through_the_gateway(gateway):
    g = gateway()
    client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
    pet = (
        client.chat.completions.parse(
            model="m",
            messages=[{"role": "user", "content": "A pet?"}],
            response_format=Pet,
            max_tokens=200,
            temperature=0.7,
            seed=2,
        )
        .choices[0]
        .message.parsed
    )
    assert isinstance(pet, Pet)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Add 2 and 3."}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].function.arguments), ADD)


def test_a_streamed_tool_call_survives_its_replicas_kill_9(gateway, llama_dir, tmp_path):
    """The matcher and the tool-call stream resume on the other replica from what the client
    has: the arguments come out whole, valid, and equal to an undisturbed run's."""
    pair = start_servers(2, llama_dir, tmp_path, "--enable-fault-injection")
    try:
        g = gateway(models={"m": {"backends": backends(pair)}})
        kw = {
            "model": "m",
            "messages": [{"role": "user", "content": "Add 2 and 3."}],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "add"}},
            "max_tokens": 120,
            "temperature": 0,
        }
        direct = openai.OpenAI(base_url=pair[0].url + "/v1", api_key="x", max_retries=0)
        expected = direct.chat.completions.create(**kw).choices[0].message.tool_calls[0]
        for p in pair:
            p.faults(step_delay_s=0.05)
        via = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
        chunks, killed = 0, None
        with via.chat.completions.stream(**kw) as stream:
            for _ in stream:
                chunks += 1
                if chunks == 8 and killed is None:
                    killed = next(p for p in pair if p.metric("vllm:num_requests_running") == 1)
                    os.kill(killed.proc.pid, signal.SIGKILL)
            final = stream.get_final_completion()
        assert killed is not None
        calls = final.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "add"
        assert calls[0].function.arguments == expected.function.arguments
        jsonschema.validate(json.loads(calls[0].function.arguments), ADD)
        metrics = httpx.get(g.url + "/metrics").text
        # From the token position, not claimed exact: the replicas are not deterministic.
        want = 'poise_gateway_stream_migrations_total{mode="position",result="resumed"} 1.0'
        assert want in metrics
    finally:
        for p in pair:
            p.stop()
