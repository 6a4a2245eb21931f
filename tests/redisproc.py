"""A real ``redis-server`` on loopback for a test: started here, stopped by pid, never assumed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

import pytest
import redis

from poise.launcher import free_port


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


class RedisServer:
    def __init__(self, work_dir: Path) -> None:
        self.exe = redis_server_binary()
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.work_dir = work_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.work_dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        end = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.RedisError:
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
