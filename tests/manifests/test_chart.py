"""The Helm chart (``k8s/chart/jupyter-gpu-hotplug``): ``helm lint`` passes, every object it
renders validates against the pinned Kubernetes schemas, its defaults render the objects of
``kubectl kustomize k8s/`` (and its CRI-O values those of the CRI-O overlay), and every value
reaches the objects it names.

What differs between the two by design, and nothing else:
- Helm's own labels (``helm.sh/chart``, ``app.kubernetes.io/managed-by``, ``…/instance``,
  ``…/version``) on every chart object;
- the Namespace: kustomize creates ``gpu-hotplug`` with its PodSecurity label; a chart installs
  into the release namespace, which the operator creates and labels (the chart's values.yaml);
- the PodMonitor/ServiceMonitor (off by default; kustomize users apply ``k8s/monitoring/``).
"""

from __future__ import annotations

import subprocess
from typing import Any, Final

import pytest

from .support import (
    CHART_DIR,
    CLUSTER_SCOPED,
    K8S_DIR,
    by_kind,
    helm,
    helm_or_skip,
    render,
    render_chart,
    validate,
)

HELM_LABELS: Final = frozenset(
    {
        "helm.sh/chart",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/version",
    }
)
CRI_O: Final = ("cri.socketDir=/var/run/crio", "cri.endpoint=unix:///var/run/crio/crio.sock")
MONITORS: Final = ("metrics.podMonitor.enabled=true", "metrics.serviceMonitor.enabled=true")
OPERATOR_KINDS: Final = frozenset({"PodMonitor", "ServiceMonitor"})
"""Prometheus Operator objects: CRDs, outside the Kubernetes schemas (checked by hand below)."""


@pytest.fixture(scope="module", autouse=True)
def _helm() -> None:
    helm_or_skip()


def _key(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _without_helm_labels(obj: dict[str, Any]) -> dict[str, Any]:
    labels = {k: v for k, v in obj["metadata"].get("labels", {}).items() if k not in HELM_LABELS}
    return {**obj, "metadata": {**obj["metadata"], "labels": labels}}


def _as_kustomize_renders(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {_key(o): o for o in objects if o["kind"] != "Namespace"}


@pytest.mark.parametrize("values", [(), CRI_O, MONITORS], ids=["defaults", "cri-o", "monitors"])
def test_helm_lint(values: tuple[str, ...]) -> None:
    argv = [helm(), "lint", "--strict", str(CHART_DIR), "--kube-version", "1.34.0"]
    for value in values:
        argv += ["--set", value]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_every_rendered_object_validates() -> None:
    objects = render_chart(*MONITORS, namespace="gpu-ops")
    for obj in objects:
        if obj["kind"] in OPERATOR_KINDS:
            continue
        validate(obj)
        namespaced = obj["kind"] not in CLUSTER_SCOPED
        assert (obj["metadata"].get("namespace") == "gpu-ops") == namespaced, _key(obj)
    # The monitors scrape the agent pods' metrics port, as the Prometheus Operator reads them.
    labels = by_kind(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    pod_monitor = by_kind(objects, "PodMonitor")
    assert pod_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    service_monitor = by_kind(objects, "ServiceMonitor")
    service = by_kind(objects, "Service")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    assert [e["port"] for e in service_monitor["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in [p["name"] for p in service["spec"]["ports"]]


def test_chart_pod_monitor_is_k8s_monitorings() -> None:
    (ours,) = [o for o in render(K8S_DIR / "monitoring") if o["kind"] == "PodMonitor"]
    from_chart = _without_helm_labels(by_kind(render_chart(*MONITORS), "PodMonitor"))
    assert from_chart == ours


@pytest.mark.parametrize(
    ("values", "overlay"), [((), K8S_DIR), (CRI_O, K8S_DIR / "overlays" / "cri-o")]
)
def test_chart_defaults_render_what_kustomize_renders(
    values: tuple[str, ...], overlay: Any
) -> None:
    from_kustomize = _as_kustomize_renders(render(overlay))
    chart = render_chart(*values)
    for obj in chart:
        assert obj["metadata"]["labels"].keys() >= HELM_LABELS, _key(obj)
    from_chart = {_key(o): _without_helm_labels(o) for o in chart}
    assert sorted(from_chart) == sorted(from_kustomize)
    for key, obj in from_chart.items():
        assert obj == from_kustomize[key], key


def _agent_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind(objects, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def _args(objects: list[dict[str, Any]]) -> dict[str, str]:
    (container,) = _agent_pod(objects)["containers"]
    return dict(arg.removeprefix("--").partition("=")[::2] for arg in container["args"])


def test_values_reach_their_objects() -> None:
    toleration = {"key": "gpu", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}
                ]
            }
        }
    }
    objects = render_chart(
        "image.repository=registry.example.org/gpu-hotplug-agent",
        "image.tag=0.2.0",
        "image.pullPolicy=Always",
        'image.pullSecrets=["regcred"]',
        "resourceName=nvidia.com/mig-1g.10gb",
        "holder.image=registry.example.org/pause:3.10",
        "holder.pullPolicy=Always",
        'holder.pullSecrets=["regcred", "holders"]',
        "holder.resources.memory=32Mi",
        "priorityClasses.holder.name=holders",
        "lostHolders.graceSeconds=120",
        "strayPolicy=revoke",
        "priorityClasses.holder.value=5000",
        "priorityClasses.agent.name=node-agents",
        "priorityClasses.agent.create=false",
        "idle.releaseSeconds=3600",
        "idle.maxLeaseSeconds=86400",
        'nodeSelector={"pool": "gpu"}',
        f"tolerations=[{_json(toleration)}]",
        f"affinity={_json(affinity)}",
        "runtimeClassName=",
        "kubelet.podResourcesDir=/var/lib/k0s/kubelet/pod-resources",
        'agent.extraEnv=[{"name": "LD_LIBRARY_PATH", "value": "/opt/nvml"}]',
        'agent.extraVolumes=[{"name": "nvml", "hostPath": {"path": "/opt/nvml"}}]',
        'agent.extraVolumeMounts=[{"name": "nvml", "mountPath": "/opt/nvml"}]',
        # Replacing the default label: null removes it from Helm's merge.
        "networkPolicy.notebookNamespaceSelector="
        '{"matchLabels": {"gpu-hotplug.jupyter.org/notebooks": null, "team": "ml"}}',
        namespace="gpu-ops",
    )
    for obj in objects:
        validate(obj)
    pod = _agent_pod(objects)
    (container,) = pod["containers"]
    args = _args(objects)
    assert container["image"] == "registry.example.org/gpu-hotplug-agent:0.2.0"
    assert container["imagePullPolicy"] == "Always"
    # The agent's and the holder image's secrets, once each (the init container pre-pulls).
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "holders"}]
    assert pod["initContainers"][0]["imagePullPolicy"] == "Always"
    # Helm merges maps (the default GPU-node label stays; null removes it); lists replace.
    assert (pod["nodeSelector"], pod["tolerations"], pod["affinity"]) == (
        {"nvidia.com/gpu.present": "true", "pool": "gpu"},
        [toleration],
        affinity,
    )
    assert "runtimeClassName" not in pod
    assert args["pod-resources-socket"] == "/var/lib/k0s/kubelet/pod-resources/kubelet.sock"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["pod-resources"]["hostPath"]["path"] == "/var/lib/k0s/kubelet/pod-resources"
    assert volumes["nvml"] == {"name": "nvml", "hostPath": {"path": "/opt/nvml"}}
    assert {"name": "LD_LIBRARY_PATH", "value": "/opt/nvml"} in container["env"]
    assert {"name": "nvml", "mountPath": "/opt/nvml"} in container["volumeMounts"]
    assert pod["priorityClassName"] == "node-agents"
    assert [p["metadata"]["name"] for p in objects if p["kind"] == "PriorityClass"] == ["holders"]
    assert by_kind(objects, "PriorityClass")["value"] == 5000
    assert args["holder-priority-class"] == "holders"
    assert (args["holder-image-pull-policy"], args["holder-memory"]) == ("Always", "32Mi")
    assert (args["lost-grace"], args["stray-policy"]) == ("120", "revoke")
    secrets = [a for a in container["args"] if a.startswith("--holder-image-pull-secret=")]
    assert secrets == ["--holder-image-pull-secret=regcred", "--holder-image-pull-secret=holders"]
    assert args["resource-name"] == "nvidia.com/mig-1g.10gb"
    assert (args["idle-release"], args["max-lease"]) == ("3600", "86400")
    assert args["holder-image"] == "registry.example.org/pause:3.10"
    assert pod["initContainers"][0]["image"] == "registry.example.org/pause:3.10"
    policy = by_kind(objects, "ValidatingAdmissionPolicy")
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["holderImage"] == "'registry.example.org/pause:3.10'"
    (condition,) = policy["spec"]["matchConditions"]
    assert "'system:serviceaccount:gpu-ops:gpu-hotplug-agent'" in condition["expression"]
    (subject,) = by_kind(objects, "ClusterRoleBinding")["subjects"]
    assert subject["namespace"] == "gpu-ops"
    api_rule = by_kind(objects, "NetworkPolicy")["spec"]["ingress"][0]
    assert api_rule["from"] == [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]


def test_switches_remove_their_objects() -> None:
    objects = render_chart(
        "admissionPolicy.enabled=false",
        "networkPolicy.enabled=false",
        "operatorRole.create=false",
        "priorityClasses.holder.create=false",
    )
    kinds = {o["kind"] for o in objects}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    assert "NetworkPolicy" not in kinds
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "ClusterRole"] == [
        "gpu-hotplug-agent"
    ]
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "PriorityClass"] == [
        "gpu-hotplug-agent"
    ]


def _json(value: object) -> str:
    import json

    return json.dumps(value)
