"""A request's priority: the body's field, the X-Priority header, and with both the less urgent
(a gateway sends the header as the most its client's key allows)."""

import pytest

from poise.protocol import APIError
from poise.server.openai_api import priority_from


def test_the_header_is_a_floor_the_body_cannot_raise():
    assert priority_from(None, None) == 0
    assert priority_from(-5, None) == -5  # a direct client of one replica decides alone
    assert priority_from(None, "3") == 3
    assert priority_from(-1000, "0") == 0  # behind a gateway: no jumping the queue
    assert priority_from(7, "0") == 7  # lowering one's own importance is allowed
    with pytest.raises(APIError) as err:
        priority_from(1, "soon")
    assert err.value.status == 400 and err.value.param == "X-Priority"


def test_no_request_may_tie_with_the_replicas_own_health_probe():
    from pydantic import ValidationError

    from poise.protocol import CompletionRequest
    from poise.server.replica import PROBE_PRIORITY

    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "priority": PROBE_PRIORITY})
    assert (
        CompletionRequest.model_validate(
            {"model": "m", "prompt": "x", "priority": PROBE_PRIORITY + 1}
        ).priority
        == PROBE_PRIORITY + 1
    )
