"""`poise up --autoscale` on loopback: load rises, a replica is added; load falls, and after the
window the replica leaves the gateway's rotation and drains while requests go on; every request
answered, none sent to the draining replica."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import yaml

from serverproc import poise_up

pytestmark = pytest.mark.slow


def serving(url: str) -> int:
    """Backends the gateway routes to on its own checks' evidence: checked healthy, not
    draining (not counting the rest that a pool in panic would also try); -1: no answer."""
    try:
        state = httpx.get(url + "/debug/state", timeout=2).json()["models"]["m"]
    except (httpx.HTTPError, ValueError, KeyError):
        return -1
    return sum(
        b["healthy"] and b["checked"] and not b["draining"] and b["url"] in state["eligible"]
        for b in state["backends"]
    )


def wait_for(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.25)
    return False


class Load:
    """Closed-loop clients, each a request then a pause; every outcome kept as the client saw
    it (a stream counts as answered only if it ended with [DONE] and no error event)."""

    def __init__(
        self, url: str, workers: int, pause_s: float, body: dict[str, object], streams: bool
    ) -> None:
        """``streams``: every other request of each worker is streamed."""
        self.url, self.pause_s, self.body, self.streams = url, pause_s, body, streams
        self.outcomes: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(workers)]
        for t in self.threads:
            t.start()

    def run(self, i: int) -> None:
        with httpx.Client(timeout=30) as c:
            n = 0
            while not self.stop.is_set():
                stream = self.streams and (n + i) % 2 == 1
                body = self.body
                n += 1
                try:
                    if stream:
                        with c.stream("POST", self.url + "/v1/completions",
                                      json={**body, "stream": True}) as r:  # fmt: skip
                            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                        ok = r.status_code == 200 and lines[-1:] == ["data: [DONE]"]
                        ok = ok and not any('"error"' in ln for ln in lines)
                        self.outcomes.append(
                            "200" if ok else f"stream {r.status_code} {lines[-2:]}"
                        )
                    else:
                        r = c.post(self.url + "/v1/completions", json=body)
                        self.outcomes.append(str(r.status_code) if r.status_code == 200
                                             else f"{r.status_code} {r.text[:300]}")  # fmt: skip
                except httpx.HTTPError as exc:
                    self.outcomes.append(f"{type(exc).__name__}: {exc}")
                time.sleep(self.pause_s)

    def end(self) -> list[str]:
        self.stop.set()
        for t in self.threads:
            t.join()
        return self.outcomes


def test_poise_up_autoscale_adds_a_replica_then_drains_it_under_load_and_fails_nothing(
    llama_dir, tmp_path
):
    cfg = tmp_path / "gateway.yaml"
    # A known service rate (3/s per replica) so that the heavy load's requests per second ask
    # for two replicas and the light load's for one; a short window so that the scale-down
    # comes within the test.
    cfg.write_text(
        yaml.safe_dump(
            {
                "autoscale": {"service_rate_prior": 3.0, "scale_down_window_s": 4.0,
                              "rate_halflife_s": 1.0, "interval_s": 0.5},
                "health": {"interval_s": 0.5, "timeout_s": 2.0},
            }
        )
    )  # fmt: skip
    log_path = tmp_path / "up.log"
    flags = ("--autoscale", "--min-replicas", "1", "--max-replicas", "2", "--gateway-config",
             str(cfg))  # fmt: skip
    outcomes: list[str] = []
    with poise_up(llama_dir, log_path, *flags) as (_, url):
        assert wait_for(lambda: serving(url) == 1, 90), log_path.read_text()[-3000:]
        heavy = Load(url, 2, 0.1, {"model": "m", "prompt": "scale", "max_tokens": 4}, False)
        try:
            assert wait_for(lambda: serving(url) == 2, 60), log_path.read_text()[-3000:]
        finally:
            outcomes += heavy.end()

        # Light load - about 1.5 requests/s, half of them streams - goes on through the
        # scale-down: the gateway takes the second replica out of rotation, then it drains.
        def drains() -> int:
            return log_path.read_bytes().count(b"replica-1 draining")

        drained_before = drains()
        body = {"model": "m", "prompt": "scale down", "max_tokens": 24, "ignore_eos": True}
        light = Load(url, 2, 1.0, body, streams=True)
        try:
            assert wait_for(lambda: drains() > drained_before, 60), log_path.read_text()[-3000:]
            assert wait_for(lambda: serving(url) == 1, 10), log_path.read_text()[-3000:]
            time.sleep(4.0)  # and on, once the replica has gone
        finally:
            during = light.end()
            outcomes += during
    out = log_path.read_text()
    failed = [o for o in outcomes if o != "200"]
    assert outcomes and not failed, (failed[:5], out[-3000:])
    assert len(during) >= 8, (len(during), out[-3000:])
    assert "replica-1 started (scale up to 2)" in out, out[-3000:]
    # Out of the gateway's rotation before its SIGTERM, so no request met it draining.
    took_out = out.rindex("replica-1 out of the gateway's rotation")
    assert took_out < out.rindex("replica-1 draining (scale down to 1)"), out[-3000:]
    assert "the server is draining and takes no new requests" not in out, out[-3000:]
