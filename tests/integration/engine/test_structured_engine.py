"""Structured output inside the engine: the same answers however the batch is run.

Greedy constrained answers must not depend on chunked prefill, preemption (recompute), prefix
cache hits or what else shares the batch: the matcher lives with the request, not with its KV.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from poise import LLM, SamplingParams
from poise.engine.structured import compile_guided

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 50},
            "minItems": 3,
            "maxItems": 6,
        },
        "label": {"type": "string", "pattern": "^[a-z]{2,6}$"},
    },
    "required": ["items", "label"],
    "additionalProperties": False,
}
PROMPTS = [f"Request number {i}: " + "some words " * (3 + 4 * i) for i in range(6)]


def _run(llm_dir, temperature: float, **engine) -> tuple[list[str], LLM]:
    llm = LLM(llm_dir, dtype="float32", **engine)
    guided = compile_guided("json_schema", SCHEMA, "guided_json")
    params = [
        SamplingParams(max_tokens=80, temperature=temperature, seed=100 + i, guided=guided)
        for i in range(len(PROMPTS))
    ]
    outs = llm.generate(PROMPTS, params)
    return [o.outputs[0].text for o in outs], llm


@pytest.fixture(scope="module")
def roomy(llama_dir):
    return {t: _run(llama_dir, t)[0] for t in (0.0, 0.9)}


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_answers_validate_and_do_not_depend_on_how_the_batch_ran(llama_dir, roomy, temperature):
    for text in roomy[temperature]:
        jsonschema.validate(json.loads(text), SCHEMA)
    # Chunked prefill and a pool so small that requests are preempted and computed again.
    tight, llm = _run(
        llama_dir,
        temperature,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
        kv_admission="optimistic",
    )
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert tight == roomy[temperature]


def test_a_prefix_cache_hit_gives_the_same_constrained_answer(llama_dir):
    llm = LLM(llama_dir, dtype="float32")
    guided = compile_guided("json_schema", SCHEMA, "guided_json")
    sp = SamplingParams(max_tokens=120, temperature=0, guided=guided)
    first = llm.generate(PROMPTS[-1], sp)[0]
    second = llm.generate(PROMPTS[-1], sp)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    jsonschema.validate(json.loads(first.outputs[0].text), SCHEMA)


def test_a_constrained_request_among_free_ones_leaves_them_as_they_were(llama_dir):
    llm = LLM(llama_dir, dtype="float32")
    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].text for o in llm.generate(PROMPTS[:3], free)]
    guided = compile_guided("regex", "[a-c]{40}", "guided_regex")
    mixed = llm.generate(
        PROMPTS[:3] + PROMPTS[:1],
        [free, free, free, SamplingParams(max_tokens=60, temperature=0, guided=guided)],
    )
    assert [o.outputs[0].text for o in mixed[:3]] == alone
    assert mixed[3].outputs[0].text and set(mixed[3].outputs[0].text) <= set("abc")
    assert len(mixed[3].outputs[0].text) == 40 and mixed[3].outputs[0].finish_reason == "stop"
