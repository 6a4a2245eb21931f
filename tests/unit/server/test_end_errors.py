"""How a request the engine ended is told to its client."""

from poise.engine.kv_cache import KVCacheManager
from poise.engine.request import Request, SamplingParams
from poise.engine.scheduler import Scheduler, SchedulerConfig
from poise.server.replica import _end_error


def test_a_request_ended_because_it_cannot_finish_says_so_and_a_late_one_says_it_was_late():
    clock = [0.0]
    s = Scheduler(SchedulerConfig(max_num_seqs=1), KVCacheManager(64, 4), lambda: clock[0])
    s.step_s = 0.05

    def add(rid: str, deadline: float) -> Request:
        r = Request(
            rid,
            [1, 2, 3],
            SamplingParams(ignore_eos=True),
            arrival_time=clock[0],
            max_tokens=100,
            deadline=deadline,
        )
        s.add_request(r)
        return r

    add("running", 60.0)
    s.schedule()
    doomed = add("doomed", 2.0)
    s.schedule()
    early = _end_error(doomed.finish_reason, doomed.error, None)
    assert early.status == 504 and "cannot finish before its deadline" in early.message
    assert "100 tokens" in early.message
    late = add("late", 3.0)
    late.output_token_ids.append(7)  # it has streamed: only its deadline ends it
    clock[0] = 3.0
    s.schedule()
    assert late.finish_reason == "timeout"
    told = _end_error(late.finish_reason, late.error, None)
    assert (
        told.status == 504 and told.message == "the request's deadline passed before it completed"
    )
