"""How a request the engine ended is told to its client."""

from poise.server.replica import _end_error


def test_a_request_ended_because_it_cannot_finish_says_so_and_a_late_one_says_it_was_late():
    early = _end_error(
        "timeout", "it cannot finish before its deadline: its tokens take longer", None
    )
    assert early.status == 504 and "cannot finish before its deadline" in early.message
    late = _end_error("timeout", "deadline passed", None)
    assert (
        late.status == 504 and late.message == "the request's deadline passed before it completed"
    )
