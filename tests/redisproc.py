"""A real ``redis-server`` on loopback for a test: installed if root may, stopped by pid."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from poise.chaos.redis_server import RedisServer as _RedisServer


def redis_server_binary() -> str:
    exe = shutil.which("redis-server")
    if exe is None and hasattr(os, "geteuid") and os.geteuid() == 0:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "redis-server"],
            check=False,
            capture_output=True,
            timeout=600,
        )
        exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("these tests need redis-server (apt-get install redis-server)")
    return exe


class RedisServer(_RedisServer):
    def __init__(self, work_dir: Path) -> None:
        super().__init__(work_dir, redis_server_binary())
