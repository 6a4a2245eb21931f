"""A real ``redis-server`` on loopback for a test, stopped by pid (``make deps`` installs it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from poise.chaos.redis_server import RedisServer as _RedisServer


def redis_server_binary() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("these tests need redis-server: `make deps` (or apt-get install redis-server)")
    return exe


class RedisServer(_RedisServer):
    def __init__(self, work_dir: Path) -> None:
        super().__init__(work_dir, redis_server_binary())
