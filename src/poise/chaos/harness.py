"""What faults act on: a local deployment (signals, Redis, HTTP) or a remote one (HTTP only)."""

from __future__ import annotations

import os
import signal
from typing import Any

import httpx

from poise.chaos.redis_server import RedisServer
from poise.chaos.scenarios import ChaosError
from poise.launcher import LocalDeployment


class LocalHarness:
    def __init__(self, deployment: LocalDeployment, redis: RedisServer | None) -> None:
        self.deployment = deployment
        self.redis = redis

    def _pid(self, index: int) -> int:
        proc = self.deployment.replicas[index].proc
        if proc is None or proc.poll() is not None:
            raise ChaosError(f"replica {index} is not running")
        return proc.pid

    def signal_replica(self, index: int, sig: signal.Signals) -> None:
        os.kill(self._pid(index), sig)

    @property
    def replica_count(self) -> int:
        return len(self.deployment.replica_urls)

    def replica_state(self, index: int) -> dict[str, Any]:
        return _state(self.deployment.replica_urls[index])

    def set_faults(self, index: int, **faults: Any) -> None:
        _faults(self.deployment.replica_urls[index], faults)

    def clear_faults(self, index: int) -> None:
        _faults(self.deployment.replica_urls[index], None)

    def signal_gateway(self, sig: signal.Signals) -> None:
        proc = self.deployment.gateway.proc
        assert proc is not None
        os.kill(proc.pid, sig)

    def stop_redis(self) -> None:
        assert self.redis is not None
        self.redis.kill()

    def start_redis(self) -> None:
        assert self.redis is not None
        self.redis.start()


class RemoteHarness:
    def __init__(self, replica_urls: list[str]) -> None:
        self.replica_urls = replica_urls

    def _url(self, index: int) -> str:
        if index >= len(self.replica_urls):
            raise ChaosError(f"this fault needs replica {index}'s URL: pass --replica URL")
        return self.replica_urls[index]

    def signal_replica(self, index: int, sig: signal.Signals) -> None:
        raise ChaosError("signals need a deployment poise chaos started itself")

    @property
    def replica_count(self) -> int:
        return len(self.replica_urls)

    def replica_state(self, index: int) -> dict[str, Any]:
        return _state(self._url(index))

    def set_faults(self, index: int, **faults: Any) -> None:
        _faults(self._url(index), faults)

    def clear_faults(self, index: int) -> None:
        _faults(self._url(index), None)

    def signal_gateway(self, sig: signal.Signals) -> None:
        raise ChaosError("signals need a deployment poise chaos started itself")

    def stop_redis(self) -> None:
        raise ChaosError("redis-down needs a deployment poise chaos started itself")

    def start_redis(self) -> None:
        self.stop_redis()


def _faults(url: str, faults: dict[str, Any] | None) -> None:
    if faults is None:
        r = httpx.delete(url + "/admin/faults", timeout=10)
    else:
        r = httpx.post(url + "/admin/faults", json=faults, timeout=10)
    if r.status_code != 200:
        raise ChaosError(f"{url}/admin/faults answered {r.status_code} (is fault injection on?)")


def _state(url: str) -> dict[str, Any]:
    """A replica's ``/debug/state``."""
    r = httpx.get(url + "/debug/state", timeout=10)
    if r.status_code != 200:
        raise ChaosError(f"{url}/debug/state answered {r.status_code}")
    state: dict[str, Any] = r.json()
    return state
