import asyncio

import pytest

from poise.engine.async_engine import AsyncEngine
from poise.engine.config import EngineConfig
from poise.engine.engine import LLMEngine
from poise.engine.errors import EngineDeadError, InvalidRequestError
from poise.engine.intake import RequestOptions
from poise.engine.request import SamplingParams


@pytest.fixture
async def engine(llama_dir):
    eng = AsyncEngine(LLMEngine(llama_dir, EngineConfig(num_kv_blocks=128)))
    eng.start()
    yield eng
    await eng.aclose()


async def test_stream_yields_tokens_then_finishes(engine):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [o async for o in engine.generate("The for statement", RequestOptions(sp))]
    assert [len(o.outputs[0].delta_token_ids) for o in outs] == [1] * 8
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text


async def test_concurrent_requests_all_finish(engine):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def one(i):
        return [o async for o in engine.generate(f"prompt {i}", RequestOptions(sp))][-1]

    results = await asyncio.gather(*(one(i) for i in range(10)))
    assert all(r.outputs[0].finish_reason == "length" for r in results)


async def test_consumer_gone_aborts_and_frees_blocks(engine):
    sp = SamplingParams(max_tokens=500, ignore_eos=True)
    stream = engine.generate("abandon me", RequestOptions(sp, request_id="gone"))
    first = await anext(stream)
    assert not first.finished
    await stream.aclose()  # the client went away
    kv = engine.engine.kv
    for _ in range(200):
        if kv.num_free_blocks == kv.num_blocks and not engine.engine.has_unfinished:
            break
        await asyncio.sleep(0.01)
    assert kv.num_free_blocks == kv.num_blocks
    assert not engine.engine.has_unfinished


async def test_bad_input_fails_in_the_callers_thread(engine):
    with pytest.raises(InvalidRequestError):
        async for _ in engine.generate("x", RequestOptions(SamplingParams(max_tokens=10**6))):
            pass


async def test_last_progress_moves(engine):
    before = engine.last_progress
    async for _ in engine.generate("tick", RequestOptions(SamplingParams(max_tokens=2))):
        pass
    assert engine.last_progress > before


async def test_dead_loop_fails_waiters_instead_of_hanging(engine):
    def broken_step():
        raise SystemError("loop bug")

    engine.engine.step = broken_step
    with pytest.raises(EngineDeadError, match="loop bug"):
        async for _ in engine.generate("x", RequestOptions(SamplingParams(max_tokens=5))):
            pass
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate("y", RequestOptions(SamplingParams(max_tokens=5))):
            pass
