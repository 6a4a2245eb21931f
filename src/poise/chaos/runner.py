"""One chaos run: bring the deployment up, load it, hurt it on time, measure, tear down.

A local run starts its own gateway and replicas (``LocalDeployment``, supervised here the way
``poise up`` supervises them, so a killed or drained replica is started again) and, for
``redis-down``, a Redis. A remote run (``--gateway URL``) loads a deployment someone else
runs; faults that act over HTTP reach its replicas through ``--replica URL`` when they were
started with ``--enable-fault-injection``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from poise.bench.client import SendOptions, auth_headers, client_session, request_body, send
from poise.bench.workload import Item, Lengths
from poise.chaos import capacity as cap
from poise.chaos import report as rep
from poise.chaos.harness import LocalHarness, RemoteHarness
from poise.chaos.load import Sent, drive, schedule
from poise.chaos.redis_server import RedisServer
from poise.chaos.sampler import Sampler
from poise.chaos.scenarios import INTERACTIVE_KEY, KEYS, ChaosError, Plan, Scenario
from poise.launcher import LocalDeployment, free_port

# Tighter than the gateway's defaults, so a fault of a short run is seen within it: every one
# of these is an ordinary setting a user of the gateway can set the same way. ``poise chaos
# --gateway-defaults`` leaves them out and tests the gateway exactly as ``poise up`` starts it.
CHAOS_GATEWAY: dict[str, Any] = {
    "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "stream_idle_s": 2.0, "total_s": 120.0},
    "health": {"interval_s": 0.5, "timeout_s": 1.0, "healthy_after": 2, "unhealthy_after": 2},
    "breaker": {"slow_call_s": 3.0, "min_calls": 5, "open_s": 5.0},
    "ejection": {"consecutive_failures": 3, "base_s": 5.0, "jitter_s": 0.5},
    "log_level": "warning",
}
SERVE_FLAGS = ("--enable-fault-injection", "--log-level", "warning")


@dataclass(frozen=True, slots=True)
class Setup:
    model: str | None = None  # a local model directory: start a local deployment
    replicas: int = 2
    gateway_url: str | None = None  # or: load this deployment
    replica_urls: tuple[str, ...] = ()
    model_name: str = "demo"
    deadline_s: float = 20.0
    grace_s: float = 5.0
    settle_s: float = 20.0  # longest wait for the deployment to let go of everything
    seed: int = 0
    work_dir: Path | None = None
    gateway_defaults: bool = False  # the gateway as poise up configures it, not CHAOS_GATEWAY


def secret(key: str) -> str:
    return f"sk-chaos-{key}"


def _api_key(scenario: Scenario) -> str | None:
    return secret(INTERACTIVE_KEY) if scenario.keyed else None


@dataclass
class _Deployed:
    gateway_url: str
    replica_urls: list[str]
    harness: LocalHarness | RemoteHarness
    events: list[tuple[float, str]] = field(default_factory=list)
    t0: float = 0.0

    def note(self, text: str) -> None:
        self.events.append((round(time.perf_counter() - self.t0, 3) if self.t0 else 0.0, text))


def gateway_settings(
    scenario: Scenario, redis_url: str | None, defaults: bool = False
) -> dict[str, Any]:
    # The defaults are all of them: a scenario's own settings (flood's gateway queue) too.
    settings: dict[str, Any] = (
        {"log_level": "warning"} if defaults else {**CHAOS_GATEWAY, **scenario.gateway}
    )
    if scenario.keyed:
        limit = {"requests_per_minute": 1_000_000} if redis_url else {}
        settings["keys"] = [
            {"key": secret(name), "name": name, "priority": prio, **limit}
            for name, prio in KEYS.items()
        ]
    if redis_url:
        settings["rate_limits"] = {"redis_url": redis_url, "redis_retry_s": 1.0}
    return settings


def run_scenario(
    scenario: Scenario, plan: Plan, setup: Setup, log: Callable[[str], None]
) -> rep.ChaosReport:
    if setup.gateway_url is None and setup.model is None:
        raise ChaosError("give --model (a local deployment) or --gateway URL")
    if setup.gateway_url is not None and scenario.local_only:
        raise ChaosError(f"{scenario.name} needs a deployment poise chaos starts (--model)")
    work = setup.work_dir or Path(tempfile.mkdtemp(prefix="poise-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    if setup.gateway_url is not None:
        urls = list(setup.replica_urls)
        remote = _Deployed(setup.gateway_url, urls, RemoteHarness(urls))
        return _run(scenario, plan, setup, remote, log)
    with _local(scenario, setup, work, log) as local:
        return _run(scenario, plan, setup, local, log)


# The deployment a capacity is measured on: a scenario without a fault or keys of its own.
_CALIBRATION = Scenario(
    "capacity", "a closed loop, no fault", lambda h: None, target=None, detect="none"
)


def measure_capacity(
    setup: Setup, lengths: tuple[Lengths, Lengths], log: Callable[[str], None]
) -> cap.Capacity:
    """The capacity of the deployment the scenarios will run on (started for it, then
    stopped, when it is local), measured as ``capacity`` describes."""
    if setup.gateway_url is None and setup.model is None:
        raise ChaosError("give --model (a local deployment) or --gateway URL")

    def on(deployed: _Deployed) -> cap.Capacity:
        # A remote gateway's replicas are counted from its /debug/state where not listed (one,
        # for a gateway that is not poise's).
        routed = _wait_routable(deployed, len(deployed.replica_urls), None)
        replicas = max(1, len(deployed.replica_urls), routed)
        calibration = cap.Calibration(cap.CLIENTS_PER_REPLICA * replicas)
        log(f"measuring capacity: {calibration.clients} clients ({replicas} replica(s)) in a "
            f"closed loop for {calibration.warm_s + calibration.window_s:g}s")  # fmt: skip

        async def run() -> cap.Capacity:
            await _warm(deployed.gateway_url, setup.model_name, None)
            return await cap.measure(deployed.gateway_url, setup.model_name, lengths, calibration)

        return asyncio.run(run())

    if setup.gateway_url is not None:
        urls = list(setup.replica_urls)
        return on(_Deployed(setup.gateway_url, urls, RemoteHarness(urls)))
    work = setup.work_dir or Path(tempfile.mkdtemp(prefix="poise-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    with _local(_CALIBRATION, setup, work, log) as local:
        return on(local)


def _run(
    scenario: Scenario, plan: Plan, setup: Setup, deployed: _Deployed, log: Callable[[str], None]
) -> rep.ChaosReport:
    _wait_routable(deployed, len(deployed.replica_urls), _api_key(scenario))
    return asyncio.run(_measure(scenario, plan, setup, deployed, log))


@contextlib.contextmanager
def _local(
    scenario: Scenario, setup: Setup, work: Path, log: Callable[[str], None]
) -> Iterator[_Deployed]:
    """A supervised deployment (and Redis) for the run; everything stopped by pid after."""
    assert setup.model is not None
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(RedisServer(work)) if scenario.needs_redis else None
        deployment = LocalDeployment.create(
            setup.model,
            setup.replicas,
            "127.0.0.1",
            free_port(),
            [*SERVE_FLAGS, *scenario.serve_flags],
            setup.model_name,
            gateway_settings(scenario, redis.url if redis else None, setup.gateway_defaults),
            log_dir=work,
        )
        deployed = _Deployed(
            deployment.url, deployment.replica_urls, LocalHarness(deployment, redis)
        )
        stop = threading.Event()

        def supervise() -> None:
            while not stop.wait(0.2):
                for line in deployment.supervise():
                    deployed.note(line)

        supervisor = threading.Thread(target=supervise, name="chaos-supervisor", daemon=True)
        log(f"starting {setup.replicas} replicas and a gateway at {deployment.url} (logs: {work})")
        try:
            deployment.start()
            supervisor.start()
            yield deployed
        finally:
            stop.set()
            if supervisor.is_alive():
                supervisor.join()
            for child in deployment.replicas:  # a stopped replica cannot drain
                if child.proc is not None and child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.proc.pid, signal.SIGCONT)
            deployment.stop()


def _wait_routable(deployed: _Deployed, replicas: int, api_key: str | None) -> int:
    """Until the gateway routes to every replica (or to something, remote without URLs), each
    seen serving by an active check: a listed backend is trusted before its first check, and
    load sent to a replica still loading its model fails and gets it ejected. Returns how
    many it routes to (0: not a poise gateway)."""
    headers = auth_headers(api_key)
    end = time.monotonic() + 180
    while time.monotonic() < end:
        try:
            state = httpx.get(
                deployed.gateway_url + "/debug/state", headers=headers, timeout=2
            ).json()
            eligible = sum(
                sum(1 for b in m["backends"] if b["checked"] and b["url"] in m["trusted"])
                for m in state["models"].values()
            )
            if eligible >= max(1, replicas):
                return eligible
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            if not replicas:
                return 0  # not a poise gateway: the warm-up requests will show if it is down
        time.sleep(0.25)
    raise ChaosError(f"the gateway at {deployed.gateway_url} did not route to every replica")


async def _warm(url: str, model: str, api_key: str | None) -> None:
    """A few requests first: the run's baseline should not include a cold start."""
    headers = auth_headers(api_key)
    async with client_session() as session:
        for i in range(4):
            body = request_body(model, Item(f"warm up {i}", 8), chat=False, ignore_eos=True)
            await send(session, url + "/v1/completions", body, headers, time.perf_counter(),
                       SendOptions(timeout_s=30))  # fmt: skip


async def _measure(
    scenario: Scenario, plan: Plan, setup: Setup, deployed: _Deployed, log: Callable[[str], None]
) -> rep.ChaosReport:
    keys = {name: secret(name) for name in KEYS} if scenario.keyed else {}
    await _warm(deployed.gateway_url, setup.model_name, _api_key(scenario))
    traffic = [plan.steady(INTERACTIVE_KEY if scenario.keyed else None), *scenario.extra(plan)]
    planned = schedule(traffic, random.Random(setup.seed))
    t0 = deployed.t0 = time.perf_counter()
    sampler = Sampler(deployed.gateway_url, deployed.replica_urls, t0, api_key=_api_key(scenario))
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    recovered = scenario.recover is None

    async def act(at: float, what: str, action: Callable[[Any], None]) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        deployed.note(what)
        log(f"t={at:.1f}s {what}")
        await asyncio.to_thread(action, deployed.harness)

    faults = [
        asyncio.create_task(act(plan.fault_at_s, f"fault: {scenario.summary}", scenario.inject))
    ]
    if scenario.recover is not None:
        faults.append(asyncio.create_task(act(plan.recover_at_s, "fault ends", scenario.recover)))
    log(f"{scenario.name}: {len(planned)} requests over {plan.duration_s:g}s, fault at "
        f"{plan.fault_at_s:.1f}s")  # fmt: skip
    try:
        sents: list[Sent] = await drive(
            deployed.gateway_url,
            setup.model_name,
            planned,
            setup.deadline_s,
            setup.grace_s,
            keys,
            t0,
        )
        await asyncio.gather(*faults)
        recovered = True
        deployed.note("load ended")
        leaks = await _settle(sampler, setup.settle_s)
    finally:
        if not recovered:
            for task in faults:
                task.cancel()
            if scenario.recover is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(scenario.recover, deployed.harness)
        stop.set()
        await sampling
    target = (
        deployed.replica_urls[scenario.target]
        if scenario.target is not None and scenario.target < len(deployed.replica_urls)
        else None
    )
    return rep.build(
        scenario.name,
        scenario.summary,
        plan,
        sents,
        sampler.samples,
        sampler.migrations
        if sampler.samples and any(s.gateway_up for s in sampler.samples)
        else None,
        scenario.detect,
        target,
        leaks,
        deployed.events,
        deployed.replica_urls,
        holds=scenario.recover is not None or len(traffic) > 1,
        offered={t.label: t.rate for t in traffic},
        model=setup.model_name,
    )


async def _settle(sampler: Sampler, settle_s: float) -> rep.Leaks:
    """Sample until nothing is held any more, or ``settle_s`` passes; what is still held."""
    end = time.perf_counter() + settle_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            s = await sampler.sample(session)
            leaks = rep.Leaks(
                kv_blocks=[r.kv_used_blocks for r in s.replicas],
                replica_requests=[r.inflight for r in s.replicas],
                gateway_requests=s.gateway_inflight,
            )
            if (leaks.clean and s.gateway_up) or time.perf_counter() > end:
                return leaks
            await asyncio.sleep(0.25)
