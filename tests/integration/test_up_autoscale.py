"""`poise up --autoscale` on loopback: load rises, a replica is added; load stops, it is drained
after the window; every request answered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from poise.launcher import free_port

pytestmark = pytest.mark.slow


def eligible(url: str) -> int:
    try:
        state = httpx.get(url + "/debug/state", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return -1
    return len(state["models"]["m"]["eligible"])


def wait_for(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.25)
    return False


def test_poise_up_autoscale_adds_then_drains_a_replica_and_loses_nothing(llama_dir, tmp_path):
    cfg = tmp_path / "gateway.yaml"
    # A known service rate (3/s per replica) so that the test's few requests per second ask
    # for two replicas; a short window so that the scale-down comes within the test.
    cfg.write_text(
        yaml.safe_dump(
            {
                "autoscale": {"service_rate_prior": 3.0, "scale_down_window_s": 4.0,
                              "rate_halflife_s": 1.0, "interval_s": 0.5},
                "health": {"interval_s": 0.5, "timeout_s": 2.0},
            }
        )
    )  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "up.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "poise.cli", "up", "--model", str(llama_dir), "--port", str(port),
         "--served-model-name", "m", "--autoscale", "--min-replicas", "1", "--max-replicas",
         "2", "--gateway-config", str(cfg)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        body = {"model": "m", "prompt": "scale", "max_tokens": 4}
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                statuses.append(c.post(url + "/v1/completions", json=body).status_code)
                time.sleep(0.1)

    try:
        assert wait_for(lambda: eligible(url) == 1, 90), (tmp_path / "up.log").read_text()
        workers = [threading.Thread(target=load) for _ in range(2)]
        for w in workers:
            w.start()
        try:
            assert wait_for(lambda: eligible(url) == 2, 60), (tmp_path / "up.log").read_text()
        finally:
            stop.set()
            for w in workers:
                w.join()
        # Quiet: after the window the second replica drains, and the gateway stops using it.
        assert wait_for(lambda: eligible(url) == 1, 60), (tmp_path / "up.log").read_text()
        after = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x",
                                                          "max_tokens": 2}, timeout=30)  # fmt: skip
        assert after.status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    out = (tmp_path / "up.log").read_text()
    assert statuses and set(statuses) == {200}, out[-2000:]
    assert "replica-1 started (scale up to 2)" in out and "replica-1 draining" in out, out[-2000:]
