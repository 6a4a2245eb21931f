"""Start ``poise gateway`` as a real process in front of given backends; stop it by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from poise.launcher import free_port, stop_process, wait_ready
from serverproc import ServerProcess


class GatewayProcess:
    def __init__(self, config: dict[str, Any], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = {"host": "127.0.0.1", "port": self.port, **config}
        self.config_path = log_dir / f"gateway-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.log_path = log_dir / f"gateway-{self.port}.log"
        self._log = self.log_path.open("wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("POISE_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "poise.cli", "gateway", "--config", str(self.config_path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            wait_ready(self.url + "/ready", self.proc, self.log, "gateway", 60)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> int:
        stop_process(self.proc, 20)
        self._log.close()
        return self.proc.returncode


def backends(procs: Sequence[ServerProcess]) -> list[dict[str, str]]:
    return [{"url": p.url} for p in procs]


@contextmanager
def gateways_before(
    replicas: Sequence[ServerProcess], log_dir: Path, health: dict[str, Any]
) -> Iterator[Callable[..., GatewayProcess]]:
    """``start(**config)`` runs a gateway for model "m" in front of ``replicas``; on the way
    out every gateway is stopped and the replicas still alive are resumed and cleared of
    injected faults, ready for the next test."""
    started: list[GatewayProcess] = []

    def start(**config: Any) -> GatewayProcess:
        cfg = {"models": {"m": {"backends": backends(replicas)}}, "health": health, **config}
        g = GatewayProcess(cfg, log_dir)
        started.append(g)
        return g

    try:
        yield start
    finally:
        for g in started:
            g.stop()
        for r in replicas:
            if r.proc.poll() is None:
                os.kill(r.proc.pid, signal.SIGCONT)
                r.faults(step_delay_s=0, fail_steps=0, error_status=0)


def gateway_metric(url: str, name: str, **labels: str) -> float:
    """Sum of a metric over the series whose labels include ``labels`` (0 when none)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        if series == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total
