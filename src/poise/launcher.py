"""``poise up``: N local replicas and a gateway in front, supervised, stopped together.

Each replica is a ``poise serve`` process on a free loopback port; the gateway gets a generated
config naming them. A replica that exits is started again on the same port after a backoff
that doubles with each quick death (capped), so a crash loop does not spin; the gateway's
health checks and breakers keep traffic away from it meanwhile. Ctrl-C or SIGTERM stops the
gateway first (no new work), then the replicas (which drain), each by its pid.

Scaling down, a replica leaves the gateway's rotation first (``/admin/backends/drain``), and
only then gets its SIGTERM, so no new request meets it draining; scaling up, it is started and
restored (``/admin/backends/restore``), and enters routing once a health check passes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import yaml

from poise.config import http_url

RESTART_BASE_S = 1.0
RESTART_CAP_S = 30.0
STABLE_AFTER_S = 30.0  # a replica up this long has its backoff reset
TAKE_OUT_S = 5.0  # scale-down waits this long for the gateway to take a replica out
SETTLE_S = 2.0  # of which up to this long for the gateway's requests on it to end
RESTORE_EVERY_S = 1.0  # a restore the gateway did not take is asked again this often


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_argv(model: str, port: int, *flags: str) -> list[str]:
    """The command line of one ``poise serve`` on loopback, in this interpreter."""
    return [
        sys.executable,
        "-m",
        "poise.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        *flags,
    ]


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    next_start: float = 0.0
    backoff_s: float = RESTART_BASE_S
    env: dict[str, str] | None = None  # None: this process's environment
    log_path: Path | None = None  # None: output to this process's
    wanted: bool = True  # False: scaled down; not started, not started again
    restore_pending: bool = False  # scaled up, but the gateway has not put it back yet

    def start(self) -> None:
        if self.log_path is None:
            self.proc = subprocess.Popen(self.argv, env=self.env)
        else:
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(
                    self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT
                )
        self.started_at = time.monotonic()

    def stop(self, timeout_s: float) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM (a poise server drains), SIGKILL if it is still there after ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stop_group(
    proc: subprocess.Popen[bytes], timeout_s: float, sig: signal.Signals = signal.SIGTERM
) -> int:
    """``sig`` to the process group ``proc`` leads (started with ``start_new_session``: a
    ``poise up`` and the servers it started), SIGKILL to the group if ``proc`` has not ended
    within ``timeout_s``. A group that has already ended is no error."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode


def answers_ok(url: str, timeout_s: float = 0.5) -> bool:
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(
    url: str,
    proc: subprocess.Popen[bytes],
    log: Callable[[], str],
    what: str,
    timeout: float,
) -> None:
    """Poll ``url`` until it answers 200; fail with the process's log if it exits or stalls."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log()}")
        if answers_ok(url, 2.0):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout}s:\n{log()}")


def replica_env(replicas: int) -> dict[str, str]:
    """The environment of each of ``replicas`` on this machine: the cores shared among them.

    Each engine's compute threads (OpenMP) would otherwise take every core, and on a small
    machine their spin-waiting against each other's measured 14x the time per output token of
    one thread each (2 replicas on 2 cores: TPOT 87 ms against 6 ms). A thread count the user
    set in ``OMP_NUM_THREADS`` is kept.
    """
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, replicas)))
    return env


@dataclass(frozen=True)
class GatewayAdmin:
    """The gateway's ``/admin/backends`` routes, as ``poise up`` uses them."""

    url: str
    model: str
    api_key: str | None = None

    def call(self, action: str, backend: str, within_s: float, **extra: float) -> dict[str, Any]:
        """POST ``/admin/backends/<action>`` for ``backend``, tried again until it answers or
        ``within_s`` passes; its answer, or RuntimeError saying why there is none."""
        end = time.monotonic() + within_s
        headers = {} if self.api_key is None else {"authorization": f"Bearer {self.api_key}"}
        body = {"model": self.model, "url": backend, **extra}
        why = "no time to ask"
        while (left := end - time.monotonic()) > 0:
            try:
                r = httpx.post(
                    f"{self.url}/admin/backends/{action}", json=body, headers=headers, timeout=left
                )
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if r.status_code == 200:
                    answer: dict[str, Any] = r.json()
                    return answer
                why = f"{r.status_code}: {r.text[:200]}"
                if (
                    r.status_code < 500
                ):  # refused (a key, an unknown backend): asking again is no use
                    break
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))
        raise RuntimeError(why)


@dataclass
class LocalDeployment:
    """Replicas and a gateway on loopback, as child processes, kept up by ``supervise``.

    ``poise up`` runs one in the foreground; ``poise chaos`` runs one and hurts it.
    """

    replicas: list[Child]
    replica_ports: list[int]
    gateway: Child
    url: str
    config_path: Path
    admin: GatewayAdmin | None = None  # None: scaling does not tell the gateway
    _next_restore: float = 0.0

    @classmethod
    def create(
        cls,
        model: str,
        replicas: int,
        host: str,
        port: int,
        serve_flags: list[str],
        model_name: str = "demo",
        gateway_settings: dict[str, Any] | None = None,
        log_dir: Path | None = None,
    ) -> LocalDeployment:
        """``gateway_settings``: more of the gateway's YAML (timeouts, keys, ...), merged in."""
        ports = [free_port() for _ in range(replicas)]
        env = replica_env(replicas)
        children = [
            Child(
                f"replica-{i}",
                serve_argv(model, p, "--served-model-name", model_name, *serve_flags),
                env=env,
                log_path=None if log_dir is None else log_dir / f"replica-{i}.log",
            )
            for i, p in enumerate(ports)
        ]
        config: dict[str, Any] = {
            "host": host,
            "port": port,
            "models": {model_name: {"backends": [{"url": f"http://127.0.0.1:{p}"} for p in ports]}},
            **(gateway_settings or {}),
        }
        cfg_path = Path(tempfile.mkdtemp(prefix="poise-up-")) / "gateway.yaml"
        cfg_path.write_text(yaml.safe_dump(config))
        gateway = Child(
            "gateway",
            [sys.executable, "-m", "poise.cli", "gateway", "--config", str(cfg_path)],
            log_path=None if log_dir is None else log_dir / "gateway.log",
        )
        url = http_url(host, port)
        keys = config.get("keys") or []
        key = next((k["key"] for k in keys if isinstance(k, dict) and k.get("key")), None)
        return cls(children, ports, gateway, url, cfg_path, GatewayAdmin(url, model_name, key))

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.replica_ports]

    def start(self, replicas: int | None = None) -> None:
        """The gateway and the first ``replicas`` replicas (all by default)."""
        for i, child in enumerate(self.replicas):
            child.wanted = replicas is None or i < replicas
            if child.wanted:
                child.start()
        self.gateway.start()

    def running(self) -> list[Child]:
        return [c for c in self.replicas if c.wanted]

    def replica_url(self, child: Child) -> str:
        return self.replica_urls[self.replicas.index(child)]

    def scale_to(self, n: int) -> list[str]:
        """Start replicas and put them back in the gateway's rotation, or drain the newest:
        out of the gateway's rotation first, then SIGTERM (they finish what they hold)."""
        said = []
        wanted = self.running()
        for child in self.replicas:
            if len(wanted) >= n:
                break
            if not child.wanted and (child.proc is None or child.proc.poll() is not None):
                child.wanted, child.backoff_s, child.next_start = True, RESTART_BASE_S, 0.0
                child.start()
                wanted.append(child)
                said.append(f"{child.name} started (scale up to {n})")
                child.restore_pending = True
                said += self._restore(child, TAKE_OUT_S, say_failure=True)
        for child in reversed(wanted[n:]):
            child.wanted = False
            child.restore_pending = False
            said.append(self._take_out(child))
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
            said.append(f"{child.name} draining (scale down to {n})")
        return said

    def _gateway_down(self) -> bool:
        return self.gateway.proc is None or self.gateway.proc.poll() is not None

    def _take_out(self, child: Child) -> str:
        """Ask the gateway to stop routing to ``child`` and wait, a bounded time, until it
        has and until what it sent there has ended; a line saying how it went."""
        if self.admin is None:
            return f"{child.name}: the gateway is not told; its health checks will notice"
        if self._gateway_down():
            return f"{child.name}: the gateway is down; stopping the replica anyway"
        try:
            state = self.admin.call("drain", self.replica_url(child), TAKE_OUT_S, wait_s=SETTLE_S)
        except RuntimeError as exc:
            return (
                f"{child.name}: the gateway did not take it out within {TAKE_OUT_S:g}s ({exc}); "
                "stopping it anyway"
            )
        return (
            f"{child.name} out of the gateway's rotation "
            f"({state.get('inflight', '?')} request(s) still on it)"
        )

    def _restore(self, child: Child, within_s: float, say_failure: bool = False) -> list[str]:
        """Put ``child`` back in the gateway's rotation (its health checks gate it still); one
        the gateway does not take now is asked again by ``supervise``."""
        if self.admin is None or not child.restore_pending:
            child.restore_pending = False
            return []
        if self._gateway_down():
            return []  # asked again by ``supervise``
        try:
            self.admin.call("restore", self.replica_url(child), within_s)
        except RuntimeError as exc:
            self._next_restore = time.monotonic() + RESTORE_EVERY_S
            if not say_failure:
                return []
            return [f"{child.name}: the gateway did not put it back yet ({exc}); asking again"]
        child.restore_pending = False
        return [f"{child.name} back in the gateway's rotation once a health check passes"]

    def supervise(self) -> list[str]:
        """Start again whatever exited, after its backoff; what happened, as lines to print."""
        said = []
        now = time.monotonic()
        for child in [*self.replicas, self.gateway]:
            if not child.wanted:
                continue  # scaled down: left to drain and exit
            assert child.proc is not None
            if child.proc.poll() is None:
                if now - child.started_at > STABLE_AFTER_S:
                    child.backoff_s = RESTART_BASE_S
                continue
            if child.next_start == 0.0:
                child.next_start = now + child.backoff_s
                said.append(
                    f"{child.name} exited with {child.proc.returncode}; "
                    f"restarting in {child.backoff_s:.0f}s"
                )
            elif now >= child.next_start:
                child.backoff_s = min(RESTART_CAP_S, child.backoff_s * 2)
                child.next_start = 0.0
                child.start()
                said.append(f"{child.name} started again")
        pending = [c for c in self.replicas if c.wanted and c.restore_pending]
        if pending and now >= self._next_restore:
            self._next_restore = now + RESTORE_EVERY_S
            for child in pending:
                said += self._restore(child, 0.5)
        return said

    def stop(self) -> None:
        """The gateway first (no new work), then the replicas, which drain."""
        self.gateway.stop(15)
        for child in self.replicas:
            child.stop(40)


def up(
    model: str,
    replicas: int,
    host: str,
    port: int,
    serve_flags: list[str],
    model_name: str = "demo",
    gateway_settings: dict[str, Any] | None = None,
    autoscale: tuple[int, int] | None = None,
) -> int:
    """``autoscale``: (min, max) replicas, moved by the gateway's advice on ``/autoscale``."""
    settings = dict(gateway_settings or {})
    if autoscale is not None:
        low, high = autoscale
        settings["autoscale"] = {
            **settings.get("autoscale", {}),
            "min_replicas": low,
            "max_replicas": high,
        }
        replicas = high  # ports for all of them; only ``low`` start
    deployment = LocalDeployment.create(
        model, replicas, host, port, serve_flags, model_name, settings
    )
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    deployment.start(None if autoscale is None else autoscale[0])
    url = deployment.url
    scaling = "" if autoscale is None else f", autoscaled between {autoscale[0]} and {replicas}"
    ports = ", ".join(str(p) for c, p in zip(deployment.replicas, deployment.replica_ports,
                                                strict=True) if c.wanted)  # fmt: skip
    print(
        f"poise up: starting a gateway at {url} in front of {len(deployment.running())} "
        f"replica(s) on ports {ports}{scaling}; config {deployment.config_path} "
        "(Ctrl-C stops all)",
        flush=True,
    )
    announced = False
    next_scale = 0.0
    try:
        while not stopping:
            if not announced and answers_ok(url + "/ready"):
                announced = True
                print(
                    f"poise up: ready at {url}. Try:\n"
                    f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\\n"
                    f'    -d \'{{"model": "{model_name}", "prompt": "The \\"for\\" statement", '
                    f'"max_tokens": 32, "temperature": 0}}\'',
                    flush=True,
                )
            lines = deployment.supervise()
            if autoscale is not None and announced and time.monotonic() >= next_scale:
                next_scale = time.monotonic() + 1.0
                desired = advised_replicas(url, model_name)
                if desired is not None:
                    lines += deployment.scale_to(desired)
            for line in lines:
                print(f"poise up: {line}", flush=True)
            time.sleep(0.2)
    finally:
        deployment.stop()
    return 0


def advised_replicas(gateway_url: str, model: str) -> int | None:
    """The gateway's autoscaling advice for ``model``; None when it has none (or is down)."""
    try:
        state = httpx.get(gateway_url + "/autoscale", timeout=2.0).json()
        decision = state["models"][model]["decision"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return None if decision is None else int(decision["desired"])
