"""End to end: a real Prometheus scrapes a gateway and two replicas, with poise's own alert
rules; a replica is killed, and the replica-down and breaker-open alerts fire through
Prometheus' own API.

The rules are the shipped ones with their ``for:`` durations cut to seconds (the expressions
are untouched), and Prometheus scrapes and evaluates every second, so the test stays short.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gatewayproc import GatewayProcess, gateway_metric
from poise.launcher import free_port, stop_process, wait_ready
from serverproc import start_servers

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


class PrometheusServer:
    def __init__(self, work: Path, jobs: dict[str, list[str]]) -> None:
        exe = shutil.which("prometheus")
        if exe is None:
            pytest.fail("this test needs prometheus: `make deps` (or apt-get install prometheus)")
        rules = work / "alerts.yml"
        rules.write_text(re.sub(r"for: \d+[smh]", "for: 2s", RULES.read_text()))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]}
                for job, targets in jobs.items()
            ],
        }
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                exe,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        wait_ready(self.url + "/-/ready", self.proc, self.log, "prometheus", 60)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=5)
        return r.json()["data"]["result"]

    def firing(self) -> list[dict]:
        alerts = httpx.get(self.url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        return [a for a in alerts if a["state"] == "firing"]

    def stop(self) -> None:
        stop_process(self.proc, 20)
        self._log.close()


def wait_for(check, timeout: float, what: str, state=None):
    """``state``: what to show when it does not come (what was firing, say)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    pytest.fail(f"not within {timeout} s: {what}" + (f"; got {state()}" if state else ""))


def test_killing_a_replica_fires_replica_down_and_breaker_open(llama_dir, tmp_path):
    replicas = start_servers(2, llama_dir, tmp_path)
    gateway = prometheus = None
    try:
        victim, survivor = replicas
        gateway = GatewayProcess(
            {
                "models": {"m": {"backends": [{"url": r.url} for r in replicas]}},
                # Checks rarely, so that the breaker, fed by live traffic, is what reacts.
                "health": {"interval_s": 60, "timeout_s": 2, "generate_probe": False},
                "breaker": {"min_calls": 2, "failure_rate": 0.5, "open_s": 120},
                "ejection": {"consecutive_failures": 1000},
            },
            tmp_path,
        )
        hostport = lambda url: url.removeprefix("http://")  # noqa: E731
        prometheus = PrometheusServer(
            tmp_path,
            {
                "poise-replica": [hostport(r.url) for r in replicas],
                "poise-gateway": [hostport(gateway.url)],
            },
        )
        wait_for(
            lambda: len(prometheus.query('up{job="poise-replica"} == 1')) == 2,
            30,
            "Prometheus scraping both replicas",
        )
        assert prometheus.firing() == [], "nothing fires while all is well"

        os.kill(victim.proc.pid, signal.SIGKILL)
        body = {"model": "m", "prompt": "still there?", "max_tokens": 2}
        # Traffic until the gateway's breaker for the victim opens: which backend each request
        # tries first is the router's (random between equals), so a fixed count could leave
        # the victim fewer than the breaker's two calls.
        statuses = []
        while len(statuses) < 40:
            r = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)
            statuses.append(r.status_code)
            if gateway_metric(gateway.url, "poise_gateway_breaker_state", backend=victim.url):
                break
        assert statuses == [200] * len(statuses), "retried on the survivor, none lost"
        open_state = gateway_metric(gateway.url, "poise_gateway_breaker_state", backend=victim.url)
        assert open_state == 2, f"the victim's breaker did not open in {len(statuses)} requests"

        def both_firing() -> dict[str, dict]:
            got = {a["labels"]["alertname"]: a for a in prometheus.firing()}
            return got if {"PoiseReplicaDown", "PoiseBreakerOpen"} <= set(got) else {}

        firing = wait_for(
            both_firing, 45, "replica-down and breaker-open alerts firing", prometheus.firing
        )
        assert firing["PoiseReplicaDown"]["labels"]["instance"] == hostport(victim.url)
        assert firing["PoiseBreakerOpen"]["labels"]["backend"] == victim.url
        assert "runbook" in firing["PoiseBreakerOpen"]["annotations"]
        down = {a["labels"].get("instance") for a in prometheus.firing()}
        assert hostport(survivor.url) not in down, "the survivor does not alert"
    finally:
        if prometheus is not None:
            prometheus.stop()
        if gateway is not None:
            gateway.stop()
        for r in replicas:
            r.stop()
