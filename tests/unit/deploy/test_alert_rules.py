"""The shipped Prometheus rules: valid for promtool, and each alert fires from synthetic series.

promtool comes with Debian's ``prometheus`` package (``.ci/run`` installs it). Each case
below gives the series a failure mode produces and when the alert must be firing; the expected
annotations are the rule's own templates with the alert's labels filled in.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

RULES = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "alerts.yml"
R1 = {"instance": "r1", "model_name": "m"}


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


# alert -> (input series, eval time, the alert's labels besides alertname and severity)
CASES: dict[str, tuple[list[dict[str, str]], str, dict[str, str]]] = {
    "PoiseReplicaDown": (
        [series("up", {"job": "poise-replica", "instance": "r1"}, "0x5")],
        "3m",
        {"job": "poise-replica", "instance": "r1"},
    ),
    "PoiseReplicaNotReady": ([series("poise_replica_ready", R1, "0x10")], "7m", R1),
    "PoiseEngineWatchdog": ([series("poise_engine_healthy", R1, "0x5")], "3m", R1),
    "PoiseNoProgressWhileWaiting": (
        [
            series("poise_engine_seconds_since_progress", R1, "60x5"),
            series("vllm:num_requests_waiting", R1, "3x5"),
        ],
        "3m",
        R1,
    ),
    "PoiseKVCacheFull": ([series("vllm:kv_cache_usage_perc", R1, "0.97x10")], "7m", R1),
    "PoisePreemptionRateHigh": (
        [series("vllm:num_preemptions_total", R1, "0+120x20")],
        "16m",
        R1,
    ),
    "PoiseInterTokenSLOBurn": (
        [
            series("vllm:inter_token_latency_seconds_bucket", {**R1, "le": "0.1"}, "0+50x70"),
            series("vllm:inter_token_latency_seconds_count", R1, "0+100x70"),
        ],
        "65m",
        {},
    ),
    "PoiseAvailabilitySLOBurnFast": (
        [
            series("poise_gateway_requests_total", {"model": "m", "outcome": "ok"}, "0+90x70"),
            series("poise_gateway_requests_total", {"model": "m", "outcome": "error"}, "0+10x70"),
        ],
        "65m",
        {},
    ),
    "PoiseAvailabilitySLOBurnSlow": (
        [
            series("poise_gateway_requests_total", {"model": "m", "outcome": "ok"}, "0+97x400"),
            series("poise_gateway_requests_total", {"model": "m", "outcome": "timeout"}, "0+3x400"),
        ],
        "370m",
        {},
    ),
    "PoiseErrorRatioHigh": (
        [
            series("poise_gateway_requests_total", {"model": "m", "outcome": "ok"}, "0+90x20"),
            series(
                "poise_gateway_requests_total", {"model": "m", "outcome": "no_backend"}, "0+10x20"
            ),
        ],
        "15m",
        {},
    ),
    "PoiseLatencySLOBurnFast": (
        [
            series("poise_gateway_time_to_first_token_seconds_bucket", {"le": "1.0"}, "0+50x70"),
            series("poise_gateway_time_to_first_token_seconds_count", {}, "0+100x70"),
        ],
        "65m",
        {},
    ),
    "PoiseLatencySLOBurnSlow": (
        [
            series("poise_gateway_time_to_first_token_seconds_bucket", {"le": "1.0"}, "0+90x400"),
            series("poise_gateway_time_to_first_token_seconds_count", {}, "0+100x400"),
        ],
        "370m",
        {},
    ),
    "PoiseBreakerOpen": (
        [series("poise_gateway_breaker_state", {"backend": "http://r1"}, "2x5")],
        "3m",
        {"backend": "http://r1"},
    ),
    "PoiseHalfOfPoolEjected": (
        [
            series("poise_gateway_backends_ejected", {"instance": "g1", "model": "m"}, "2x5"),
            series("poise_gateway_backends", {"instance": "g1", "model": "m"}, "3x5"),
        ],
        "3m",
        {"instance": "g1", "model": "m"},
    ),
    "PoisePredictedSuccessBelowSLO": (
        # Weighted by requests: (0.996 · 300 + 1 · 700) / 1000 = 0.9988.
        [
            series(name, {"model": "m", "instance": i}, v)
            for name, i, v in (
                ("poise_gateway_predicted_success_probability", "g1", "0.996x20"),
                ("poise_gateway_predicted_success_requests", "g1", "300x20"),
                ("poise_gateway_predicted_success_probability", "g2", "1x20"),
                ("poise_gateway_predicted_success_requests", "g2", "700x20"),
            )
        ],
        "15m",
        {"model": "m"},
    ),
    "PoiseSheddingHigh": (
        [
            series("poise_gateway_shed_total", {"model": "m", "reason": "shed"}, "0+30x30"),
            series("poise_gateway_requests_total", {"model": "m", "outcome": "shed"}, "0+30x30"),
            series("poise_gateway_requests_total", {"model": "m", "outcome": "ok"}, "0+70x30"),
        ],
        "20m",
        {"model": "m"},
    ),
    "PoiseRetryBudgetExhausted": (
        [series("poise_gateway_retry_budget_exhausted_total", {"instance": "g1"}, "0+1x20")],
        "12m",
        {"instance": "g1"},
    ),
    "PoiseRedisFallbackActive": (
        [series("poise_gateway_ratelimit_redis_up", {"instance": "g1"}, "0x5")],
        "4m",
        {"instance": "g1"},
    ),
}


def alerts() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is missing: `make deps` (or apt-get install prometheus)")
    return subprocess.run([tool, *args], check=False, capture_output=True, text=True, timeout=120)


def render(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)


def test_promtool_accepts_the_rules():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_says_what_happened_and_what_to_do():
    rules = alerts()
    assert set(rules) == set(CASES), "every alert has a firing case below, and only those"
    for name, rule in rules.items():
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), name
        assert rule["labels"]["severity"] in ("page", "ticket"), name


def test_each_alert_fires_from_the_series_its_failure_produces(tmp_path):
    rules = alerts()
    tests = []
    for name, (inputs, at, labels) in CASES.items():
        rule = rules[name]
        expected = {**labels, "severity": rule["labels"]["severity"]}
        annotations = {k: render(v, labels) for k, v in rule["annotations"].items()}
        tests.append(
            {
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [
                    {
                        "eval_time": at,
                        "alertname": name,
                        "exp_alerts": [{"exp_labels": expected, "exp_annotations": annotations}],
                    },
                    # And not before its failure had time to show.
                    {"eval_time": "0m", "alertname": name, "exp_alerts": []},
                ],
            }
        )
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(
        yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests})
    )
    out = promtool("test", "rules", str(spec))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]


def test_healthy_series_fire_nothing(tmp_path):
    healthy = [
        series("up", {"job": "poise-replica", "instance": "r1"}, "1x400"),
        series("poise_replica_ready", R1, "1x400"),
        series("poise_engine_healthy", R1, "1x400"),
        series("poise_engine_seconds_since_progress", R1, "0x400"),
        series("vllm:num_requests_waiting", R1, "2x400"),
        series("vllm:kv_cache_usage_perc", R1, "0.5x400"),
        series("vllm:num_preemptions_total", R1, "0x400"),
        series("poise_gateway_requests_total", {"model": "m", "outcome": "ok"}, "0+1000x400"),
        series("poise_gateway_requests_total", {"model": "m", "outcome": "error"}, "0+0x400"),
        series("poise_gateway_time_to_first_token_seconds_bucket", {"le": "1.0"}, "0+999x400"),
        series("poise_gateway_time_to_first_token_seconds_count", {}, "0+1000x400"),
        series("poise_gateway_breaker_state", {"backend": "http://r1"}, "0x400"),
        series("poise_gateway_backends_ejected", {"model": "m"}, "0x400"),
        series("poise_gateway_backends", {"model": "m"}, "3x400"),
        series("poise_gateway_retry_budget_exhausted_total", {}, "0x400"),
        series("poise_gateway_ratelimit_redis_up", {}, "1x400"),
        series("poise_gateway_predicted_success_probability", {"model": "m"}, "0.9995x400"),
        series("poise_gateway_predicted_success_requests", {"model": "m"}, "5000x400"),
        # A quiet gateway's one failure among a handful: not enough to judge.
        series("poise_gateway_predicted_success_probability", {"model": "q"}, "0.9x400"),
        series("poise_gateway_predicted_success_requests", {"model": "q"}, "10x400"),
    ]
    checks = [
        {"eval_time": t, "alertname": name, "exp_alerts": []}
        for name in CASES
        for t in ("30m", "380m")
    ]
    spec = tmp_path / "quiet_test.yml"
    spec.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(RULES)],
                "evaluation_interval": "1m",
                "tests": [{"interval": "1m", "input_series": healthy, "alert_rule_test": checks}],
            }
        )
    )
    out = promtool("test", "rules", str(spec))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
