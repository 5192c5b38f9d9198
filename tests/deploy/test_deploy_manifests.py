"""deploy/: every overlay renders with `kubectl kustomize`, every object validates offline (the
Kubernetes schemas of kubernetes-validate; our schemas of the custom resources), the objects point at
each other correctly, pods drain before they die, and the alert rules and the dashboard read only
metrics a real gateway exports."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from crd_schemas import CUSTOM

from benchmarks.server_process import ServerProcess

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = ("embedded", "redis-postgres", "fleet")
KUBERNETES_VERSION = "1.32.0"
_RENDERED: dict[str, list[dict[str, Any]]] = {}


def render(overlay: str) -> list[dict[str, Any]]:
    if overlay not in _RENDERED:
        out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "overlays" / overlay)],
                             check=False, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        _RENDERED[overlay] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _RENDERED[overlay]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates(overlay: str) -> None:
    objects = render(overlay)
    assert objects
    for obj in objects:
        schema = CUSTOM.get((obj["apiVersion"], obj["kind"]))
        if schema is not None:
            jsonschema.validate(obj, schema)
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_is_caught() -> None:
    """The checks above can fail: a typo in a Deployment and in a ScaledObject are both refused."""
    deployment = by_kind(render("fleet"), "Deployment")["sluice-worker"]
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = typo["spec"]["template"]["spec"][
        "containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, KUBERNETES_VERSION, strict=True)
    scaled = json.loads(json.dumps(by_kind(render("fleet"), "ScaledObject")["sluice-worker"]))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # KEDA wants strings
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, CUSTOM[("keda.sh/v1alpha1", "ScaledObject")])


def _env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    maps = by_kind(objects, "ConfigMap")
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]]["data"])
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve_and_pods_drain_before_they_die(overlay: str) -> None:
    objects = render(overlay)
    deployments = by_kind(objects, "Deployment")
    secrets, maps = by_kind(objects, "Secret"), by_kind(objects, "ConfigMap")
    pod_labels = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}

    def selects(selector: dict[str, str]) -> list[str]:
        return [n for n, labels in pod_labels.items() if selector.items() <= labels.items()]

    for d in deployments.values():
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        pod = d["spec"]["template"]["spec"]
        for c in pod["containers"]:
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
            for source in c.get("envFrom", []):
                ref = source.get("secretRef") or source.get("configMapRef")
                assert ref["name"] in (secrets if "secretRef" in source else maps)
            for e in c.get("env", []):
                if "valueFrom" in e:
                    key = e["valueFrom"]["secretKeyRef"]
                    assert key["key"] in secrets[key["name"]]["stringData"]
            env = _env(objects, c)
            pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
            assert pre_stop[0] == "sleep"  # never a signal: a second SIGTERM cuts the drain short
            drain, longest = float(env["SLUICE_DRAIN_TIMEOUT_S"]), float(env["SLUICE_STREAM_TIMEOUT_S"])
            assert drain >= longest
            assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + drain
    for svc in by_kind(objects, "Service").values():
        assert selects(svc["spec"]["selector"]), svc["metadata"]["name"]
    for pdb in by_kind(objects, "PodDisruptionBudget").values():
        assert selects(pdb["spec"]["selector"]["matchLabels"]), pdb["metadata"]["name"]
    scaled: list[str] = []
    for hpa in by_kind(objects, "HorizontalPodAutoscaler").values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
        scaled.append(hpa["spec"]["scaleTargetRef"]["name"])
    for so in by_kind(objects, "ScaledObject").values():
        assert so["spec"]["scaleTargetRef"]["name"] in deployments
        scaled.append(so["spec"]["scaleTargetRef"]["name"])
    assert len(scaled) == len(set(scaled)), "two autoscalers fight over one Deployment"
    monitor = by_kind(objects, "ServiceMonitor")["sluice"]
    credentials = monitor["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert credentials["key"] in secrets[credentials["name"]]["stringData"]


def test_overlays_differ_where_they_should() -> None:
    embedded, shared, fleet = (render(o) for o in OVERLAYS)
    gateway = by_kind(embedded, "Deployment")["sluice-gateway"]
    assert gateway["spec"]["replicas"] == 1 and gateway["spec"]["strategy"]["type"] == "Recreate"
    assert not by_kind(embedded, "HorizontalPodAutoscaler")  # one SQLite file: one replica
    assert "sluice-backends" in by_kind(shared, "Secret")
    assert by_kind(shared, "HorizontalPodAutoscaler")["sluice-gateway"]["spec"]["minReplicas"] >= 2
    so = by_kind(fleet, "ScaledObject")["sluice-worker"]["spec"]
    assert so["minReplicaCount"] == 0  # scale from zero: the gateways hold requests meanwhile
    assert "sluice_desired_workers" in so["triggers"][0]["metadata"]["query"]
    assert by_kind(fleet, "ConfigMap")["sluice-gateway"]["data"]["SLUICE_SCALING_MIN_WORKERS"] == "0"


# -- the rules and the dashboard read what a gateway exports ----------------------------------------

_METRIC = re.compile(r"\b(?:sluice_|gen_ai_|vllm:)[A-Za-z0-9_:]*")


def _queries(objects: list[dict[str, Any]]) -> Iterator[str]:
    for rule_set in by_kind(objects, "PrometheusRule").values():
        for group in rule_set["spec"]["groups"]:
            for rule in group["rules"]:
                yield rule["expr"]
    dashboard = json.loads((DEPLOY / "monitoring" / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            yield target["expr"]
    for so in by_kind(objects, "ScaledObject").values():
        yield so["spec"]["triggers"][0]["metadata"]["query"]


def test_alert_rules_and_dashboard_read_only_exported_metrics() -> None:
    options = ["--driver", "synthetic", "--synthetic-tokens-per-second", "500", "--synthetic-ttft-ms", "2"]
    with ServerProcess(options, startup_timeout_s=60) as server:
        body = {"model": "synthetic", "prompt": "one two three", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            r.read()
        text = httpx.get(f"{server.base_url}/metrics", timeout=60).text
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    # A labelled family with no sample yet (no request shed so far) is still declared by its TYPE line.
    suffixes = {"histogram": ("_bucket", "_count", "_sum")}  # a counter's TYPE line has its _total already
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            exported |= {name + suffix for suffix in suffixes.get(kind, ("",))}
    recorded = {rule["record"] for rs in by_kind(render("fleet"), "PrometheusRule").values()
                for g in rs["spec"]["groups"] for rule in g["rules"] if "record" in rule}
    used = {m for q in _queries(render("fleet")) for m in _METRIC.findall(q)}
    assert {"sluice_desired_workers", "vllm:num_requests_waiting", "sluice_node_sluggish"} <= used
    missing = sorted(m for m in used - recorded if m not in exported)
    assert not missing, f"read by deploy/ but not exported: {missing}"
