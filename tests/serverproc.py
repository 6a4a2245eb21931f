"""Start ``poise serve`` as a real process on loopback, wait until ready, stop it by pid."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from poise.launcher import free_port, serve_argv, stop_group, stop_process, wait_ready


class ServerProcess:
    def __init__(self, model: Path, log_dir: Path, *flags: str, ready: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{self.port}.log"
        self._log = self.log_path.open("wb")
        cmd = serve_argv(str(model), self.port, "--served-model-name", "m", *flags)
        env = {k: v for k, v in os.environ.items() if not k.startswith("POISE_")}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._engine_pid: int | None = None
        if ready:
            self.wait_ready()

    def wait_ready(self, timeout: float = 120.0) -> None:
        wait_ready(self.url + "/ready", self.proc, self.log, "server", timeout)
        self.engine_pid = engine_core_pid(self.proc.pid)

    @property
    def engine_pid(self) -> int | None:
        return self._engine_pid

    @engine_pid.setter
    def engine_pid(self, pid: int | None) -> None:
        self._engine_pid = pid

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        if m is None:
            raise KeyError(name)
        return float(m.group(1))

    def wait_metric(self, name: str, value: float, timeout: float = 10.0) -> float:
        end = time.monotonic() + timeout
        seen = self.metric(name)
        while seen != value and time.monotonic() < end:
            time.sleep(0.05)
            seen = self.metric(name)
        return seen

    def faults(self, **settings: object) -> None:
        r = httpx.post(self.url + "/admin/faults", json=settings, timeout=5)
        r.raise_for_status()

    def clear_faults(self) -> None:
        r = httpx.delete(self.url + "/admin/faults", timeout=5)
        r.raise_for_status()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        stop_process(self.proc, 30)
        if self._engine_pid is not None:  # it ends by itself when the server goes; make sure
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._engine_pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode


def start_servers(count: int, model: Path, log_dir: Path, *flags: str) -> list[ServerProcess]:
    """``count`` servers started together (they load side by side), each ready on return; if
    one does not come up, all are stopped."""
    servers: list[ServerProcess] = []
    try:
        for _ in range(count):
            servers.append(ServerProcess(model, log_dir, *flags, ready=False))
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def engine_core_pid(server_pid: int) -> int | None:
    """The pid of the server's engine core process (a multiprocessing child), if it has one."""
    children = []  # each thread's own children: the core is started from a loader thread
    for task in Path(f"/proc/{server_pid}/task").glob("*"):
        try:
            children += (task / "children").read_text().split()
        except OSError:
            continue
    for child in children:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            return int(child)
    return None


@contextlib.contextmanager
def poise_up(
    model: Path, log_path: Path, *flags: str
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``poise up`` for ``model`` on a free port, serving it as "m", with ``flags``, its output in
    ``log_path``: (its process, the gateway's URL). Stopped as Ctrl-C would (SIGINT to its
    session), then SIGKILL if it has not ended within 60 s."""
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "poise.cli", "up", "--model", str(model), "--port", str(port),
             "--served-model-name", "m", *flags],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            yield proc, f"http://127.0.0.1:{port}"
        finally:
            stop_group(proc, 60, signal.SIGINT)
