"""Chunked prefill × abort, timeout or preemption × prefix reuse, token for token as transformers.

A prompt chunk that ends mid-block leaves the rest of that block unwritten. When its request then
ends or is preempted, the next request with the same prefix (or the same request, back from the
queue) must not adopt that block from the prefix cache: it would attend to K/V nobody computed
and answer differently from transformers (issue 17, item 9). Every scenario below interrupts a
request right after such a chunk, then serves the same prefix again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

from hfreference import save_transformers_checkpoint, transformers_greedy
from poise import SamplingParams
from poise.engine.config import EngineConfig
from poise.engine.engine import LLMEngine
from poise.engine.intake import RequestOptions
from poise.engine.outputs import RequestOutput
from poise.engine.request import RequestStatus
from testconfigs import TINY_HF_CONFIG

MAX_NEW = 8
PROMPTS = {
    "long": [1, *range(100, 123)],  # 24 tokens: 6 blocks of 4
    "long+": [1, *range(100, 123), *range(300, 310)],  # shares all of "long"'s blocks
    "hi": [1, 40, 41, 42],
    "mid": [1, *range(200, 207)],  # 8 tokens
}
# Block size 4 and 6 tokens a step: a prompt's first chunk ends in the middle of its 2nd block.
SETUP = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 6}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, llama_dir) -> Path:
    root = tmp_path_factory.mktemp("prefix-cache-parity")
    return save_transformers_checkpoint(root / "llama", LlamaConfig(**TINY_HF_CONFIG), llama_dir)


@pytest.fixture(scope="module")
def references(checkpoint) -> dict[str, list[int]]:
    names = list(PROMPTS)
    tokens = transformers_greedy(checkpoint, [PROMPTS[n] for n in names], MAX_NEW)
    return dict(zip(names, tokens, strict=True))


def _add(
    engine: LLMEngine,
    name: str,
    rid: str,
    max_tokens: int = MAX_NEW,
    priority: int = 0,
    deadline: float | None = None,
) -> str:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    options = RequestOptions(sp, request_id=rid, priority=priority, deadline=deadline)
    request, _ = engine.prepare_request(PROMPTS[name], options)
    engine.add_request(request)
    return rid


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(500):
        if not engine.has_unfinished:
            break
        done |= _finished(engine.step())
    assert not engine.has_unfinished
    return done


def _finished(outputs: list[RequestOutput]) -> dict[str, RequestOutput]:
    return {o.request_id: o for o in outputs if o.finished}


def _interrupt_mid_block(engine: LLMEngine, clock: FakeClock, how: str) -> dict[str, RequestOutput]:
    """Leave "long" (abort, timeout) or "mid" (preempt) cut off after a chunk ending mid-block;
    the requests that finished meanwhile."""
    if how == "preempt":
        # "hi" takes a block and "mid" another for its first 2 tokens; "hi"'s next token takes
        # the last block, and "mid", wanting one more, yields.
        _add(engine, "hi", "hi", max_tokens=2, priority=0)
        _add(engine, "mid", "mid", max_tokens=4, priority=1)
        done = _finished(engine.step())
        assert engine.scheduler.requests["mid"].num_computed_tokens == 2
        done |= _finished(engine.step())
        assert engine.scheduler.requests["mid"].status is RequestStatus.PREEMPTED
        return done
    _add(engine, "long", "cut", deadline=clock.now + 1.0)
    engine.step()
    assert engine.scheduler.requests["cut"].num_computed_tokens == 6
    if how == "abort":
        assert engine.abort_request("cut")
        done = _finished(engine.take_finished_outputs())
    else:
        clock.now += 2.0
        done = _finished(engine.step())
    assert done["cut"].outputs[0].finish_reason == how
    return done


@pytest.mark.parametrize("how", ["abort", "timeout", "preempt"])
def test_interrupted_chunk_then_same_prefix_matches_transformers(checkpoint, references, how):
    clock = FakeClock()
    # Three blocks: "hi" and "mid" cannot both hold what they need, so one is preempted.
    blocks = 3 if how == "preempt" else 64
    engine = LLMEngine(
        checkpoint,
        # Started optimistically: "mid" starts beside "hi" and one of them must give way.
        EngineConfig(**SETUP, num_kv_blocks=blocks, kv_admission="optimistic"),
        clock=clock,
    )
    done = _interrupt_mid_block(engine, clock, how)
    if how == "preempt":
        done |= _drain(engine)
        assert engine.scheduler.num_preemptions_total >= 1
        assert done["hi"].outputs[0].token_ids == references["hi"][:2]
        assert done["mid"].outputs[0].token_ids == references["mid"][:4]
        again = {_add(engine, "mid", "mid-again", max_tokens=4): references["mid"][:4]}
    else:
        again = {
            _add(engine, "long", "long-again"): references["long"],
            _add(engine, "long+", "long+"): references["long+"],
        }
    done = _drain(engine)
    assert {rid: done[rid].outputs[0].token_ids for rid in again} == again
    assert engine.kv.stats.hit_tokens > 0  # the prefix was served from the cache
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
