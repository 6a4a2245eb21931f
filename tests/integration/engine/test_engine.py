"""The engine's promises: every request ends once, bad input changes nothing, blocks come back."""

import pytest

from poise import LLM, SamplingParams
from poise.engine.config import EngineConfig
from poise.engine.engine import LLMEngine
from poise.engine.errors import InvalidRequestError, RequestTooLargeError
from poise.engine.intake import RequestOptions


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine(llama_dir):
    return LLMEngine(llama_dir, EngineConfig(num_kv_blocks=64, block_size=4))


def add(engine, prompt, **kw):
    request, text = engine.prepare_request(
        prompt, RequestOptions(SamplingParams(temperature=0, **kw))
    )
    engine.add_request(request, text)
    return request.request_id


def run_all(engine):
    finished = {}
    for _ in range(1000):
        if not engine.has_unfinished:
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished[out.request_id] = out
    return finished


def test_abort_mid_generation_frees_blocks(engine):
    a = add(engine, "The for statement", max_tokens=50, ignore_eos=True)
    b = add(engine, "A function definition", max_tokens=5, ignore_eos=True)
    engine.step()
    engine.step()
    assert engine.abort_request(a)
    done = run_all(engine)
    assert done[a].outputs[0].finish_reason == "abort"
    assert done[b].outputs[0].finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.abort_request(a)  # already gone: nothing happens


def test_failed_step_fails_only_its_requests(engine):
    a = add(engine, "first", max_tokens=5, ignore_eos=True)
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real_execute(out)

    engine.runner.execute = flaky
    outs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [(a, "error")]
    assert "simulated kernel failure" in outs[0].error
    b = add(engine, "second", max_tokens=5, ignore_eos=True)
    done = run_all(engine)
    assert done[b].outputs[0].finish_reason == "length"  # the engine lives on
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_deadline_finishes_as_timeout(llama_dir):
    clock = FakeClock()
    engine = LLMEngine(llama_dir, EngineConfig(num_kv_blocks=64), clock=clock)
    sp = SamplingParams(max_tokens=100, ignore_eos=True)
    request, _ = engine.prepare_request("slow", RequestOptions(sp, deadline=clock.now + 1.0))
    engine.add_request(request)
    engine.step()
    clock.now += 2.0
    outs = engine.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "timeout"
    assert outs[0].error == "deadline passed"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_bad_input_is_refused_and_changes_nothing(engine):
    limit = engine.max_model_len
    with pytest.raises(InvalidRequestError, match="context"):
        engine.prepare_request([5] * (limit + 1), RequestOptions(SamplingParams()))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.prepare_request([], RequestOptions(SamplingParams()))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.prepare_request([10**9], RequestOptions(SamplingParams()))
    with pytest.raises(RequestTooLargeError, match="whole pool has 64"):
        engine.prepare_request("hello", RequestOptions(SamplingParams(max_tokens=1000)))
    assert not engine.has_unfinished
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_chat_uses_the_template(llama_dir):
    llm = LLM(llama_dir)
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3))[0]
    tok = llm.get_tokenizer()
    expected = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False
    )
    assert out.prompt_token_ids == expected


def test_one_bad_prompt_in_a_batch_adds_nothing(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64)
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", {"prompt_token_ids": []}, "also fine"], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished
    outs = llm.generate(["after"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 2


def test_a_request_the_shrunk_pool_has_no_room_for_is_counted(engine):
    """Two requests that each want most of a shrunk pool: the second waits for room, and the
    engine counts it once (what a replica reports as ``room_waits_total``); both finish."""
    engine.kv.limit = 12  # 48 token slots
    for prompt in ("The for statement", "A function definition"):
        add(engine, prompt, max_tokens=30, ignore_eos=True)  # ~9 blocks each, projected
    for _ in range(3):
        engine.step()
    assert engine.stats().num_room_waits == 1
    done = run_all(engine)
    assert len(done) == 2 and engine.stats().num_room_waits == 1
    assert engine.kv.num_free_blocks == 12
