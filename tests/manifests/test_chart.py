"""The Helm chart (``k8s/chart/jupyter-gpu-hotplug``): ``helm lint`` passes, every object it
renders validates against the pinned Kubernetes schemas, its defaults render the objects of
``kubectl kustomize k8s/`` (and its CRI-O values those of the CRI-O overlay), and every value
reaches the objects it names. Its ``values.schema.json`` types every value, gives the same
verdict as the agent on every value the agent checks, and makes Helm refuse a wrong type, an
unknown key or a bad enum or pattern, naming the value.

What differs between the two by design, and nothing else:
- Helm's own labels (``helm.sh/chart``, ``app.kubernetes.io/managed-by``, ``…/instance``,
  ``…/version``) on every chart object;
- the Namespace: kustomize creates ``gpu-hotplug`` with its PodSecurity label; a chart installs
  into the release namespace, which the operator creates and labels (the chart's values.yaml);
- the monitoring objects (off by default; kustomize users apply ``k8s/monitoring/``): the
  PodMonitor/ServiceMonitor, the PrometheusRule and the dashboard's ConfigMap, which with the
  chart's values are ``k8s/monitoring``'s own, and which kube-prometheus-stack's default
  selectors pick up given its ``release`` label.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import pytest
import yaml
from jsonschema import Draft7Validator  # type: ignore[import-untyped]

from jupyter_gpu_hotplug.agent.core.lost import LostPolicy
from jupyter_gpu_hotplug.agent.settings import (
    PULL_POLICIES,
    STRAY_POLICIES,
    AgentSettings,
    KubernetesSettings,
    LabelSelector,
    LogStyle,
    SettingsError,
    TcpAddress,
)

from .support import (
    CHART_DIR,
    CLUSTER_SCOPED,
    K8S_DIR,
    agent_config,
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
MONITORS: Final = (
    "metrics.podMonitor.enabled=true",
    "metrics.serviceMonitor.enabled=true",
    "metrics.rules.enabled=true",
    "metrics.dashboard.enabled=true",
)
OPERATOR_KINDS: Final = frozenset({"PodMonitor", "ServiceMonitor", "PrometheusRule"})
"""Prometheus Operator objects: CRDs, outside the Kubernetes schemas (checked by hand below)."""
SCHEMA: Final[dict[str, Any]] = json.loads((CHART_DIR / "values.schema.json").read_text())
DEFAULTS: Final[dict[str, Any]] = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
HELM_SCHEMA_ERROR: Final = "values don't meet the specifications of the schema(s)"


# Helm from tests/realnode/build.sh: the real-node lane of .ci/test, which builds it first.
pytestmark = pytest.mark.realnode


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


def test_chart_monitoring_is_k8s_monitorings() -> None:
    """The PodMonitor, the rules and the dashboard: the chart's copies
    (``files/prometheusrule-groups.yaml``, ``files/gpu-hotplug-dashboard.json``) are
    ``k8s/monitoring``'s, and the ServiceMonitor scrapes with the same target labels."""
    ours = {_key(o): o for o in render(K8S_DIR / "monitoring")}
    chart = {_key(o): _without_helm_labels(o) for o in render_chart(*MONITORS)}
    for key in ("PodMonitor/gpu-hotplug-agent", "PrometheusRule/gpu-hotplug-agent"):
        assert chart[key] == ours[key], key
    dashboard = "ConfigMap/gpu-hotplug-dashboard"
    assert chart[dashboard] == ours[dashboard]
    targets = ours["PodMonitor/gpu-hotplug-agent"]["spec"]["podTargetLabels"]
    assert chart["ServiceMonitor/gpu-hotplug-agent"]["spec"]["podTargetLabels"] == targets


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A matchLabels selector's verdict (kube-prometheus-stack's defaults use no expressions)."""
    assert selector.keys() == {"matchLabels"}
    return bool(selector["matchLabels"].items() <= labels.items())


@pytest.mark.parametrize("release", ["kube-prometheus-stack", "monitoring"])
def test_kube_prometheus_stacks_default_selectors_pick_the_monitoring_up(release: str) -> None:
    """kube-prometheus-stack's Prometheus selects ServiceMonitors, PodMonitors and
    PrometheusRules by ``release: <its release name>`` (``*SelectorNilUsesHelmValues: true``,
    its default) in every namespace; its Grafana sidecar loads ConfigMaps labelled
    ``grafana_dashboard: "1"``. Without the label the chart's objects are not picked up."""
    kps_selector = {"matchLabels": {"release": release}}
    sidecar = {"matchLabels": {"grafana_dashboard": "1"}}
    kinds = {"podMonitor": "PodMonitor", "serviceMonitor": "ServiceMonitor"}
    kinds |= {"rules": "PrometheusRule"}
    labelled = render_chart(*MONITORS, *(f"metrics.{v}.labels.release={release}" for v in kinds))
    bare = render_chart(*MONITORS)
    for kind in kinds.values():
        assert _selects(kps_selector, by_kind(labelled, kind)["metadata"]["labels"]), kind
        assert not _selects(kps_selector, by_kind(bare, kind)["metadata"]["labels"]), kind
    dashboard = by_kind(bare, "ConfigMap", "gpu-hotplug-dashboard")
    assert _selects(sidecar, dashboard["metadata"]["labels"])
    extra = render_chart(*MONITORS, "metrics.dashboard.labels.team=ml")
    labels = by_kind(extra, "ConfigMap", "gpu-hotplug-dashboard")["metadata"]["labels"]
    assert labels["team"] == "ml"


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
        "defaultMaxGpus=0",
        'allowedNamespaces=["jhub", "ml-team"]',
        "allowedNamespaceSelector=team=ml\\,!legacy",  # Helm: an escaped comma
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
    assert (args["default-max-gpus"], args["allowed-namespace-selector"]) == (
        "0",
        "team=ml,!legacy",
    )
    allowed = [a for a in container["args"] if a.startswith("--allowed-namespaces=")]
    assert allowed == ["--allowed-namespaces=jhub", "--allowed-namespaces=ml-team"]
    secrets = [a for a in container["args"] if a.startswith("--holder-image-pull-secret=")]
    assert secrets == ["--holder-image-pull-secret=regcred", "--holder-image-pull-secret=holders"]
    assert args["resource-name"] == "nvidia.com/mig-1g.10gb"
    assert (args["idle-release"], args["max-lease"]) == ("3600", "86400")
    assert args["holder-image"] == "registry.example.org/pause:3.10"
    assert pod["initContainers"][0]["image"] == "registry.example.org/pause:3.10"
    policy = by_kind(objects, "ValidatingAdmissionPolicy", "gpu-hotplug-agent-holders-only")
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["holderImage"] == "'registry.example.org/pause:3.10'"
    (condition,) = policy["spec"]["matchConditions"]
    assert "'system:serviceaccount:gpu-ops:gpu-hotplug-agent'" in condition["expression"]
    protection = by_kind(objects, "ValidatingAdmissionPolicy", "gpu-hotplug-holders-agent-only")
    (condition,) = protection["spec"]["matchConditions"]
    assert "!= 'system:serviceaccount:gpu-ops:gpu-hotplug-agent'" in condition["expression"]
    (subject,) = by_kind(objects, "ClusterRoleBinding")["subjects"]
    assert subject["namespace"] == "gpu-ops"
    api_rule = by_kind(objects, "NetworkPolicy")["spec"]["ingress"][0]
    assert api_rule["from"] == [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]


def test_a_digest_pins_the_agents_image() -> None:
    """``image.digest`` (issue 35): the agent runs ``repository@digest``, what a signed-image
    admission policy verifies; the tag is then not used."""
    digest = "sha256:" + "0123456789abcdef" * 4
    objects = render_chart(
        "image.repository=registry.example.org:5000/gpu-hotplug-agent",
        "image.tag=0.2.0",
        f"image.digest={digest}",
    )
    (container,) = _agent_pod(objects)["containers"]
    assert container["image"] == f"registry.example.org:5000/gpu-hotplug-agent@{digest}"
    validate(by_kind(objects, "DaemonSet"))
    assert _schema_admits(_values(image__digest=digest))
    for wrong in ("sha256:abc", "0123456789abcdef" * 4, f"sha512:{'0' * 64}", f"{digest} "):
        assert not _schema_admits(_values(image__digest=wrong)), wrong


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


def test_switches_remove_the_host_systemd_mounts() -> None:
    pod = _agent_pod(render_chart("hostSystemd.enabled=false"))
    (container,) = pod["containers"]
    assert not {"host-systemd", "host-dbus"} & {v["name"] for v in pod["volumes"]}
    assert not {"host-systemd", "host-dbus"} & {m["name"] for m in container["volumeMounts"]}
    assert "DBUS_SYSTEM_BUS_ADDRESS" not in {e["name"] for e in container["env"]}


def _json(value: object) -> str:
    return json.dumps(value)


# --- values.schema.json ---------------------------------------------------------------------


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = SCHEMA["definitions"][node["$ref"].removeprefix("#/definitions/")]
    return node


def _untyped(node: dict[str, Any], value: object, path: str) -> list[str]:
    """The paths under ``value`` that ``node`` (a schema) leaves without a type."""
    node = _resolve(node)
    branches = [_resolve(branch) for branch in node.get("anyOf", [node])]
    if not all("type" in branch for branch in branches):
        return [path or "/"]
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            sub = node.get("properties", {}).get(key, node.get("additionalProperties"))
            if not isinstance(sub, dict):
                found.append(f"{path}/{key} (no schema)")
            else:
                found += _untyped(sub, item, f"{path}/{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _untyped(node["items"], item, f"{path}/{index}")
    return found


def _values(**changes: object) -> dict[str, Any]:
    """The chart's defaults with ``changes`` applied (keys of a path joined by ``__``)."""
    values = copy.deepcopy(DEFAULTS)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = values
        for key in parents:
            node = node[key]
        node[last] = value
    return values


def _schema_admits(values: dict[str, Any]) -> bool:
    return bool(Draft7Validator(SCHEMA).is_valid(values))


def test_the_schema_is_draft_07_and_types_every_value() -> None:
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    Draft7Validator.check_schema(SCHEMA)
    Draft7Validator(SCHEMA).validate(DEFAULTS)
    assert _untyped(SCHEMA, DEFAULTS, "") == []
    # No other value is admitted (a typo is an error), and every one the templates use
    # unguarded is required (a null there would render a broken flag); the placement values
    # and the runtime class are written only when given.
    assert SCHEMA["additionalProperties"] is False
    optional = {"nodeSelector", "tolerations", "affinity", "runtimeClassName"}
    assert sorted(SCHEMA["required"]) == sorted(DEFAULTS.keys() - optional)


def test_the_schemas_enums_are_the_agents() -> None:
    props = SCHEMA["properties"]
    enum = {
        "image.pullPolicy": _resolve(props["image"]["properties"]["pullPolicy"])["enum"],
        "holder.pullPolicy": _resolve(props["holder"]["properties"]["pullPolicy"])["enum"],
        "strayPolicy": props["strayPolicy"]["enum"],
        "lostHolders.policy": props["lostHolders"]["properties"]["policy"]["enum"],
        "agent.logFormat": props["agent"]["properties"]["logFormat"]["enum"],
    }
    assert enum == {
        "image.pullPolicy": list(PULL_POLICIES),
        "holder.pullPolicy": list(PULL_POLICIES),
        "strayPolicy": list(STRAY_POLICIES),
        "lostHolders.policy": [p.value for p in LostPolicy],
        "agent.logFormat": [s.value for s in LogStyle],
    }


def _k8s(**settings: Any) -> object:
    return KubernetesSettings(node_name="gpu-node-1", **settings)


def _agent(**settings: Any) -> object:
    base = AgentSettings(listen=(TcpAddress("", 8477),), state_dir=Path("/run/gpu-hotplug"))
    return dataclasses.replace(base, **settings)


def _seconds(name: str) -> Callable[[float], object]:
    def check(value: float) -> object:
        return _agent(**{name: value})

    return check


AGREEMENT: Final[list[tuple[str, Callable[[Any], object], list[object]]]] = [
    (
        "resourceName",
        lambda v: _k8s(resource_name=v),
        ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "example.com/Foo_bar.1", "gpu",
         "nvidia.com/", "/gpu", "Nvidia.com/gpu", "nvidia.com/gpu-", "nvidia.com/mig 1g"],
    ),
    (
        "holder__resources__cpu",
        lambda v: _k8s(holder_cpu=v),
        ["10m", "0.5", "1", "250m", "ten", "10 m", "-1", "1e3", "10mi", "", ".5"],
    ),
    (
        "holder__resources__memory",
        lambda v: _k8s(holder_memory=v),
        ["24Mi", "1Gi", "32M", "24mi", "24MB", "1Ti", "24 Mi"],
    ),
    (
        "holder__pullPolicy",
        lambda v: _k8s(holder_image_pull_policy=v),
        ["Always", "IfNotPresent", "Never", "always", "Sometimes"],
    ),
    (
        "holder__pullSecrets",
        lambda v: _k8s(holder_image_pull_secrets=tuple(v)),
        [["regcred"], ["a.b-c", "x"], ["Regcred"], ["reg_cred"], ["-x"], ["a" * 254]],
    ),
    (
        "strayPolicy",
        lambda v: _agent(stray_policy=v),
        ["report", "revoke", "Report", "delete"],
    ),
    (
        "defaultMaxGpus",
        lambda v: _k8s(default_max_gpus=v),
        [0, 1, 4, 255, 256, -1],
    ),
    (
        "allowedNamespaces",
        lambda v: _k8s(allowed_namespaces=tuple(v)),
        [[], ["jhub"], ["*"], ["a-b", "c1"], ["Jhub"], ["a_b"], ["-a"], ["a.b"], ["**"],
         ["a" * 64]],
    ),
    (
        "allowedNamespaceSelector",
        lambda v: _k8s(allowed_namespace_selector=LabelSelector.parse(v)),
        ["", "gpu-hotplug.jupyter.org/notebooks=true", "team==ml,!legacy", "a!=b", "a",
         "a=", "example.com/Key_1.x=V-1", "a=b,", "a=b, c", "!a=b", "a in (b)", "a=b=c",
         "Example.com/a=b", "a=-b", "/a"],
    ),
    ("lostHolders__policy", LostPolicy, ["revoke", "force", "kill", ""]),
    ("agent__logFormat", LogStyle, ["text", "json", "yaml"]),
    ("idle__releaseSeconds", _seconds("idle_release_seconds"), [0, 0.5, 3600, -1, -0.1]),
    ("idle__warningSeconds", _seconds("idle_warning_seconds"), [0, 60, -1]),
    ("idle__maxLeaseSeconds", _seconds("max_lease_seconds"), [0, 86400, -5]),
    ("lostHolders__graceSeconds", _seconds("lost_grace_seconds"), [0, 30, 2.5, -30]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "agent", "candidates"), AGREEMENT, ids=[case[0] for case in AGREEMENT]
)
def test_the_schema_and_the_agent_agree(
    path: str, agent: Callable[[Any], object], candidates: list[object]
) -> None:
    """For every value the agent checks, the schema's verdict is the agent's: what it would
    refuse at start (a DaemonSet that never becomes ready) Helm refuses before installing."""

    def agent_admits(value: object) -> bool:
        try:
            agent(value)
        except (SettingsError, ValueError):
            return False
        return True

    verdicts = {
        repr(value): (agent_admits(value), _schema_admits(_values(**{path: value})))
        for value in candidates
    }
    assert {v: a for v, (a, _) in verdicts.items()} == {v: s for v, (_, s) in verdicts.items()}
    assert any(a for a, _ in verdicts.values()) and not all(a for a, _ in verdicts.values())


def test_where_the_schema_is_stricter_than_the_agent() -> None:
    """Where the chart puts a value into an object, the API's rules (or the policy's) apply on
    top of the agent's, and the schema holds the stricter one."""
    # The agent takes any object name as the holders' class, or none (each holder then takes
    # its notebook's); a class the chart *creates* needs a name outside the API's reserved
    # system- prefix, and a user-defined priority of at most 10^9.
    for name in ("gpu-hotplug-holder", "", "system-cluster-critical"):
        _k8s(holder_priority_class=name)
        existing = {"create": False, "name": name, "value": 1000}
        assert _schema_admits(_values(priorityClasses__holder=existing))
    assert _schema_admits(_values(priorityClasses__holder__name="holders"))
    assert not _schema_admits(_values(priorityClasses__holder__name=""))
    assert not _schema_admits(_values(priorityClasses__holder__name="system-holders"))
    assert not _schema_admits(_values(priorityClasses__agent__value=2_000_000_000))
    # The agent skips an empty pull secret; the chart would write it into the agent pod's
    # imagePullSecrets as a reference to no Secret.
    _k8s(holder_image_pull_secrets=("",))
    assert not _schema_admits(_values(holder__pullSecrets=[""]))
    # The agent takes any non-empty holder image; the chart also writes it into a CEL string
    # literal of the admission policy, where a quote would change the policy's expression.
    _k8s(holder_image="pause' || true || '")
    assert not _schema_admits(_values(holder__image="pause' || true || '"))
    assert _schema_admits(
        _values(holder__image="registry.example.org:5000/pause@sha256:" + "0" * 64)
    )


def _helm_template(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm(), "template", "gpu-hotplug", str(CHART_DIR), "--kube-version", "1.34.0", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("agent.port=api", "at '/agent/port': got string, want integer"),
        (
            "admissionPolicy.enabled=maybe",
            "at '/admissionPolicy/enabled': got string, want boolean",
        ),
        ("strayPolcy=revoke", "at '': additional properties 'strayPolcy' not allowed"),
        ("holder.imag=pause", "at '/holder': additional properties 'imag' not allowed"),
        ("strayPolicy=delete", "at '/strayPolicy': value must be one of 'report', 'revoke'"),
        ("lostHolders.policy=kill", "at '/lostHolders/policy': value must be one of"),
        ("image.pullPolicy=always", "at '/image/pullPolicy': value must be one of"),
        ("resourceName=gpu", "at '/resourceName': 'gpu' does not match pattern"),
        ("holder.resources.memory=24MB", "at '/holder/resources/memory'"),
        ("priorityClasses.holder.name=system-holders", "at '/priorityClasses/holder/name'"),
        ("lostHolders.graceSeconds=-5", "at '/lostHolders/graceSeconds': minimum"),
        ("metrics.podMonitor.interval=30sec", "at '/metrics/podMonitor/interval'"),
        ("holder.image=pause' || true || '", "at '/holder/image'"),
        ("image.digest=sha256:0123", "at '/image/digest': 'sha256:0123' does not match pattern"),
        ('tolerations=[{"key": "gpu", "operator": "Is"}]', "at '/tolerations/0/operator'"),
    ],
)
def test_helm_refuses_what_the_schema_refuses(value: str, says: str) -> None:
    flag = "--set-json" if value.partition("=")[2].startswith("[") else "--set"
    result = _helm_template(flag, value)
    assert result.returncode != 0
    assert result.stdout == ""
    assert HELM_SCHEMA_ERROR in result.stderr and says in result.stderr, result.stderr


def test_helm_lint_refuses_what_the_schema_refuses() -> None:
    argv = [helm(), "lint", "--strict", str(CHART_DIR), "--kube-version", "1.34.0"]
    argv += ["--set", "strayPolicy=delete"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert "at '/strayPolicy': value must be one of" in result.stdout + result.stderr


def test_the_api_and_metrics_ports_differ() -> None:
    result = _helm_template("--set", "metrics.port=8477")
    assert result.returncode != 0
    assert "agent.port and metrics.port are both 8477" in result.stderr


def test_the_agent_accepts_what_the_schema_admits_at_its_edges() -> None:
    """Values at the edges of what the schema admits render arguments the agent starts with."""
    objects = render_chart(
        "resourceName=example.com/Foo_bar.1",
        "holder.resources.cpu=1",  # an integer, from --set
        "holder.resources.memory=0.5Gi",
        "lostHolders.graceSeconds=0",
        "lostHolders.policy=force",
        "agent.logFormat=text",
        "priorityClasses.holder.create=false",
        "priorityClasses.holder.name=",
        "holder.pullPolicy=Never",
        'holder.pullSecrets=["a.b-c"]',
        "idle.maxLeaseSeconds=86400",
        "defaultMaxGpus=255",
        'allowedNamespaces=["*"]',
        "allowedNamespaceSelector=",
    )
    (container,) = _agent_pod(objects)["containers"]
    config = agent_config(container["args"])
    k8s = config["kubernetes"]
    assert (k8s["resource_name"], k8s["holder_cpu"], k8s["holder_memory"]) == (
        "example.com/Foo_bar.1",
        "1",
        "0.5Gi",
    )
    assert (k8s["holder_priority_class"], k8s["holder_image_pull_secrets"]) == ("", ["a.b-c"])
    assert (config["lost_grace_seconds"], config["lost_policy"]) == (0, "force")
    assert config["max_lease_seconds"] == 86400
    assert (k8s["default_max_gpus"], k8s["allowed_namespaces"]) == (255, ["*"])
    assert k8s["allowed_namespace_selector"] == ""


def test_rbac_scope_namespaces_grants_pods_in_the_allowed_namespaces_only() -> None:
    """Issue 31, finding 7: the narrowest RBAC can do. Pods, their finalizers and Events move
    from the ClusterRole to RoleBindings in each allowed namespace; the cluster-wide part keeps
    only TokenReview, SubjectAccessReview and RuntimeClasses (no namespace read: no selector);
    the agent is told (--rbac-scope) and accepts it."""
    objects = render_chart(
        "rbacScope=namespaces", 'allowedNamespaces=["jhub","team"]', "allowedNamespaceSelector="
    )
    cluster_rules = by_kind(objects, "ClusterRole", "gpu-hotplug-agent")["rules"]
    assert {r for rule in cluster_rules for r in rule["resources"]} == {
        "tokenreviews",
        "subjectaccessreviews",
        "runtimeclasses",
    }
    pod_rules = by_kind(objects, "ClusterRole", "gpu-hotplug-agent-pods")["rules"]
    assert {r for rule in pod_rules for r in rule["resources"]} == {
        "pods",
        "pods/finalizers",
        "events",
    }
    bindings = [o for o in objects if o["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["jhub", "team"]
    for binding in bindings:
        assert binding["roleRef"]["name"] == "gpu-hotplug-agent-pods"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "gpu-hotplug-agent", "namespace": "gpu-hotplug"}
        ]
    (container,) = _agent_pod(objects)["containers"]
    k8s = agent_config(container["args"])["kubernetes"]
    assert (k8s["rbac_scope"], k8s["allowed_namespaces"]) == ("namespaces", ["jhub", "team"])


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ((), "at '/allowedNamespaces': minItems"),
        (('allowedNamespaces=["*"]', "allowedNamespaceSelector="), "at '/allowedNamespaces/0'"),
        (('allowedNamespaces=["jhub"]',), "at '/allowedNamespaceSelector'"),
    ],
)
def test_rbac_scope_namespaces_needs_the_namespaces_by_name(
    values: tuple[str, ...], says: str
) -> None:
    argv = ["--set", "rbacScope=namespaces"]
    for value in values:
        argv += ["--set-json" if value.partition("=")[2].startswith("[") else "--set", value]
    result = _helm_template(*argv)
    assert result.returncode != 0
    assert HELM_SCHEMA_ERROR in result.stderr and says in result.stderr, result.stderr
