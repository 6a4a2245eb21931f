"""A request's latency objective through the gateway: what is left of its first-token budget
when each attempt leaves, its per-token budget as sent, and a malformed one refused."""

from __future__ import annotations

from test_admin_drain import gateway, until


def _lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def test_the_gateway_forwards_what_is_left_of_the_objective():
    with gateway(1) as (client, (backend,)):
        assert until(lambda: client.get("/ready").status_code == 200)
        body = {"model": "m", "prompt": "x", "max_tokens": 1}
        asked = {"x-slo-ttft-ms": "800", "x-slo-tpot-ms": "50.5"}
        assert client.post("/v1/completions", json=body, headers=asked).status_code == 200
        sent = _lower(backend.received[-1][0])
        assert 0 < int(sent["x-slo-ttft-ms"]) <= 800
        assert sent["x-slo-tpot-ms"] == "50.5"
        assert not any(k.startswith("x-poise-first-token") for k in sent)
        # Without one, none is made up.
        assert client.post("/v1/completions", json=body).status_code == 200
        assert "x-slo-ttft-ms" not in _lower(backend.received[-1][0])


def test_a_malformed_objective_is_a_400_naming_it_and_nothing_is_sent():
    with gateway(1) as (client, (backend,)):
        assert until(lambda: client.get("/ready").status_code == 200)
        body = {"model": "m", "prompt": "x", "max_tokens": 1}
        for header, value in (("x-slo-ttft-ms", "soon"), ("x-slo-tpot-ms", "-5")):
            r = client.post("/v1/completions", json=body, headers={header: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == header
        assert backend.received == []
