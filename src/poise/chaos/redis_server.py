"""A ``redis-server`` on loopback that chaos (and the tests) start, kill and start again.

Started on a fixed port so that, started again after a kill, it is the same address the
gateways were configured with; stopped by its pid, never assumed to be running.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from poise.launcher import free_port


class RedisServer:
    def __init__(self, work_dir: Path, exe: str | None = None) -> None:
        found = exe or shutil.which("redis-server")
        if found is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.exe = found
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.work_dir = work_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.work_dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
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
