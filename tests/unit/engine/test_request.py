import pytest

from poise.engine.errors import InvalidRequestError
from poise.engine.request import IllegalTransitionError, Request, RequestStatus, SamplingParams


def make(**kw) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**kw), arrival_time=0.0, max_tokens=4)


def test_request_ends_exactly_once():
    r = make()
    r.transition(RequestStatus.RUNNING)
    r.finish(RequestStatus.FINISHED_ABORTED)
    assert r.finish_reason == "abort"
    with pytest.raises(IllegalTransitionError):
        r.finish(RequestStatus.FINISHED_STOPPED)
    assert r.finish_reason == "abort"


def test_illegal_transitions_raise():
    r = make()
    with pytest.raises(IllegalTransitionError):
        r.transition(RequestStatus.PREEMPTED)  # waiting cannot be preempted
    with pytest.raises(IllegalTransitionError):
        r.transition(RequestStatus.FINISHED_STOPPED)  # finishing goes through finish()


def test_stop_rules():
    r = Request(
        "r",
        [1],
        SamplingParams(stop_token_ids=[7]),
        0.0,
        max_tokens=3,
        eos_token_ids=frozenset({9}),
    )
    r.append_output_token(5)
    assert r.check_stop_token() is None
    r.append_output_token(9)
    assert r.check_stop_token() is RequestStatus.FINISHED_STOPPED
    r2 = Request(
        "r", [1], SamplingParams(ignore_eos=True), 0.0, max_tokens=2, eos_token_ids=frozenset({9})
    )
    r2.append_output_token(9)
    assert r2.check_stop_token() is None
    r2.append_output_token(7)
    assert r2.check_stop_token() is RequestStatus.FINISHED_LENGTH
    r3 = Request("r", [1], SamplingParams(stop_token_ids=[7], min_tokens=2), 0.0, max_tokens=5)
    r3.append_output_token(7)
    assert r3.check_stop_token() is None  # min_tokens holds stop tokens back


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.2}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert param in str(err.value)


def test_sampling_params_normalise():
    sp = SamplingParams(stop="END", top_k=-1)
    assert sp.stop == ["END"]
    assert sp.top_k == 0
