"""The scenario catalogue and the settings a chaos run gives its deployment."""

from __future__ import annotations

import signal

import pytest

from poise.chaos.harness import RemoteHarness
from poise.chaos.runner import Setup, gateway_settings, run_scenario
from poise.chaos.scenarios import SCENARIOS, ChaosError, Plan
from poise.gateway.config import GatewaySettings

PLAN = Plan.of(duration_s=60.0, rate=4.0, capacity=25.0)


def test_the_issue_s_eleven_scenarios_are_all_there():
    assert set(SCENARIOS) == {
        "kill-replica", "hang-replica", "slow-replica", "error-replica", "step-exception",
        "kv-exhaustion", "disconnect-storm", "flood", "redis-down", "drain", "gateway-restart",
    }  # fmt: skip


def test_the_fault_holds_the_middle_third_and_extra_traffic_only_then():
    assert (PLAN.fault_at_s, PLAN.recover_at_s) == (20.0, 40.0)
    (flood,) = SCENARIOS["flood"].extra(PLAN)
    assert (flood.start_s, flood.end_s, flood.rate) == (20.0, 40.0, 250.0)
    assert not flood.counts_for_recovery and flood.key == "batch"
    (storm,) = SCENARIOS["disconnect-storm"].extra(PLAN)
    assert storm.abandon_share == 0.5


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_scenario_s_gateway_settings_are_a_valid_gateway_config(name):
    extra = gateway_settings(SCENARIOS[name], "redis://127.0.0.1:1/0")
    settings = GatewaySettings.model_validate(
        {"models": {"demo": {"backends": [{"url": "http://127.0.0.1:1"}]}}, **extra}
    )
    assert settings.timeouts.stream_idle_s == 2.0
    if SCENARIOS[name].keyed:
        assert {k.name: k.priority for k in settings.keys} == {"interactive": 0, "batch": 10}


def test_faults_that_need_a_process_refuse_a_remote_deployment():
    remote = RemoteHarness(["http://127.0.0.1:1"])
    with pytest.raises(ChaosError, match="signals"):
        remote.signal_replica(0, signal.SIGKILL)
    with pytest.raises(ChaosError, match="--replica"):
        RemoteHarness([]).set_faults(0, step_delay_s=1.0)
    setup = Setup(gateway_url="http://127.0.0.1:1")
    with pytest.raises(ChaosError, match="needs a deployment"):
        run_scenario(SCENARIOS["kill-replica"], PLAN, setup, print)
    with pytest.raises(ChaosError, match="--model"):
        run_scenario(SCENARIOS["flood"], PLAN, Setup(), print)


def test_kv_exhaustion_against_a_remote_gateway_needs_the_replicas():
    with pytest.raises(ChaosError, match="--replica"):
        SCENARIOS["kv-exhaustion"].inject(RemoteHarness([]))
