"""Start a real vLLM OpenAI server (the CPU build, from the venv ``make test`` builds under
``.cache/vllm-venv``) on loopback; stop it, and every process it started, by process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

from poise.launcher import free_port

VLLM_VENV = Path(__file__).resolve().parent.parent / ".cache" / "vllm-venv"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"


class VllmProcess:
    def __init__(
        self, model: Path, log_dir: Path, served_name: str = "m", cpus: str = "0-1"
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"vllm-{self.port}.log"
        self._log = self.log_path.open("wb")
        # Niced: its worker busy-polls for a second after each step (vLLM's shm queue), which
        # on a 2-core host with the gateway, the tests and other servers beside it would
        # starve them; here the servers it shares the cores with go first.
        argv = [
            "nice", "-n", "10",
            str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", served_name,
            "--dtype", "bfloat16", "--max-model-len", "1024", "--no-enable-prefix-caching",
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("POISE_", "VLLM_"))},
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # Its engine's threads on these cores: two servers on a 2-core host each get their
            # own, as on separate machines (its threads spin while it works).
            "VLLM_CPU_OMP_THREADS_BIND": cpus,
            "OMP_WAIT_POLICY": "PASSIVE",  # idle threads sleep rather than spin
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        # A session of its own: its engine core and workers go with it when it is stopped.
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        _nice_session(self.proc.pid)

    def wait_ready(self, timeout: float = 420.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM did not start in {timeout:g}s:\n{self.log()}")

    def engine_core_pid(self) -> int:
        """vLLM V1's engine core: the child process that names itself VLLM::EngineCore."""
        for child in _children(self.proc.pid):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"VLLM::EngineCore"):
                    return child
        raise RuntimeError("vLLM has no engine core process")

    def keep_busy(self, stop: threading.Event, i: int) -> None:
        """Whole answers one after another until ``stop``, of a length set by ``i`` (holders
        given different ones do not end together); each stops at its end."""
        body = {"model": "m", "prompt": "busy", "max_tokens": 400 + 60 * i, "ignore_eos": True}
        while not stop.is_set():
            httpx.post(self.url + "/v1/completions", json=body, timeout=120).raise_for_status()

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def kill(self) -> None:
        """A crash: SIGKILL to every process of its group at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)  # a test may have left a process stopped
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        # The engine core and workers too, whatever became of the server process.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


def _nice_session(pid: int) -> None:
    """Where the kernel groups each session's processes for scheduling (autogroup), a process's
    nice value only ranks it within its session: the session's own must be set too, or a new
    session's busy threads weigh as much as all of the tests'. The kernel takes one such write
    in 100 ms from a process without CAP_SYS_ADMIN (EAGAIN otherwise); none at all where
    autogroup is off or absent."""
    path = Path(f"/proc/{pid}/autogroup")
    for _ in range(30):
        try:
            path.write_text("10")
            return
        except BlockingIOError:
            time.sleep(0.11)
        except OSError:
            return


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def start_vllm(count: int, model: Path, log_dir: Path) -> list[VllmProcess]:
    """``count`` servers started together, each ready on return, each engine on a core of its
    own (round robin); if one fails, all stop."""
    servers: list[VllmProcess] = []
    try:
        ncpu = os.cpu_count() or 1
        for i in range(count):
            servers.append(VllmProcess(model, log_dir, cpus=str(i % ncpu)))
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
