"""The priority a gateway forwards: its key's floor in X-Priority, and in the body when the
client put one there (a backend such as vLLM reads only the body)."""

from __future__ import annotations

from test_admin_drain import gateway, until


def test_a_client_cannot_raise_its_priority_past_its_keys_in_the_body_it_sends():
    keys = [{"key": "sk-batch-0001", "name": "batch", "priority": 5}]
    with gateway(1, keys=keys) as (client, (backend,)):
        assert until(lambda: client.get("/ready").status_code == 200)
        auth = {"Authorization": "Bearer sk-batch-0001"}
        for asked in (-1000, 9, None):
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            if asked is not None:
                body["priority"] = asked
            assert client.post("/v1/completions", json=body, headers=auth).status_code == 200
        sent = [(h.get("X-Priority") or h.get("x-priority"), b.get("priority"))
                for h, b in backend.received]  # fmt: skip
        # -1000 is held to the key's 5; lowering one's importance (9) passes; no field, none.
        assert sent == [("5", 5), ("9", 9), ("5", None)]
