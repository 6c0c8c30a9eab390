"""``k8s/``: renders with kustomize 5, every object validates against the pinned Kubernetes
schemas, and the objects say what DESIGN §3 and §4 and the agent need — and no more."""

from __future__ import annotations

import re
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from jupyter_gpu_hotplug._structs import (
    AGENT_PORT,
    CONTAINER_ANNOTATION,
    IDLE_RELEASE_ANNOTATION,
    MAX_GPUS_ANNOTATION,
)
from jupyter_gpu_hotplug.agent.kubernetes import holders
from jupyter_gpu_hotplug.linux.systemd_units import SYSTEMD_RUN_DIR
from jupyter_gpu_hotplug.spawner import DEFAULT_K8S_AGENT_URL

from .support import CLUSTER_SCOPED, K8S_DIR, agent_config, by_kind, render, validate

AGENT = "gpu-hotplug-agent"
POLICY = "gpu-hotplug-agent-holders-only"
METRICS_PORT = 8478


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render()


def test_every_object_validates(objects: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Namespace",
        "NetworkPolicy",
        "PriorityClass",
        "PriorityClass",
        "Service",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ValidatingAdmissionPolicyBinding",
    ]
    for obj in objects:
        validate(obj)
        namespaced = obj["kind"] not in CLUSTER_SCOPED
        assert (obj["metadata"].get("namespace") == "gpu-hotplug") == namespaced, obj["kind"]


def test_agent_role_is_least_privilege(objects: list[dict[str, Any]]) -> None:
    rules = {
        (group, resource): sorted(rule["verbs"])
        for rule in by_kind(objects, "ClusterRole", AGENT)["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert rules == {
        ("", "pods"): ["create", "delete", "get", "list", "patch", "watch"],
        ("", "pods/finalizers"): ["update"],
        ("", "events"): ["create", "patch"],
        ("events.k8s.io", "events"): ["create", "patch"],
        ("authentication.k8s.io", "tokenreviews"): ["create"],
        ("authorization.k8s.io", "subjectaccessreviews"): ["create"],
        ("node.k8s.io", "runtimeclasses"): ["get"],
        # The namespace allowlist reads the target's Namespace labels: get, never list.
        ("", "namespaces"): ["get"],
    }
    binding = by_kind(objects, "ClusterRoleBinding", AGENT)
    assert binding["roleRef"]["name"] == AGENT
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": AGENT, "namespace": "gpu-hotplug"}
    ]
    operator = by_kind(objects, "ClusterRole", "gpu-hotplug-operator")
    assert operator["rules"] == [
        {"apiGroups": [""], "resources": ["pods/gpus"], "verbs": ["get", "create", "delete"]}
    ]


def test_daemonset(objects: list[dict[str, Any]]) -> None:
    daemonset = by_kind(objects, "DaemonSet", AGENT)
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert "hostNetwork" not in pod
    assert pod["serviceAccountName"] == AGENT
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # Liveness waits for the first answer, and a slow start has minutes (the production node's
    # agent under emulation was killed in a loop before the start-up probe).
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/healthz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "--backend=kubernetes" in container["args"]
    assert f"--listen=:{AGENT_PORT}" in container["args"]
    assert f"--metrics-listen=:{METRICS_PORT}" in container["args"]
    assert container["ports"] == [
        {"name": "http", "containerPort": AGENT_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
    ]
    # Our own class: system-node-critical is refused outside kube-system on some clouds.
    assert pod["priorityClassName"] == AGENT
    holder_class = by_kind(objects, "PriorityClass", "gpu-hotplug-holder")
    assert by_kind(objects, "PriorityClass", AGENT)["value"] > holder_class["value"] > 0
    assert "--holder-priority-class=gpu-hotplug-holder" in container["args"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {
        "host-proc": "/proc",
        "cgroup": "/sys/fs/cgroup",
        "pod-resources": "/var/lib/kubelet/pod-resources",
        "cri": "/run/containerd",
        "state": "/run/gpu-hotplug",
        "host-root": "/",
        "cdi-0": "/etc/cdi",
        "cdi-1": "/var/run/cdi",
        "host-systemd": "/run/systemd",
        "host-dbus": "/run/dbus",
    }
    read_only = {m["name"] for m in container["volumeMounts"] if m.get("readOnly")}
    # Written: the device cgroups (the agent's job) and its own state; nothing else.
    assert read_only == {
        "host-proc", "pod-resources", "cri", "cdi-0", "cdi-1", "host-root", "host-systemd",
        "host-dbus",
    }  # fmt: skip
    assert "/dev" not in host_paths.values()


def test_host_systemd_is_mounted_without_faking_one(objects: list[dict[str, Any]]) -> None:
    """The agent reaches the host's systemd where there is one (``/run/systemd/system`` at the
    path it looks for, the system bus at the address it dials) and the pod still starts where
    there is none: the parents are mounted with ``DirectoryOrCreate``, never the marker
    directory or the socket themselves (``Directory``/``Socket`` would fail the mount on such a
    node; creating ``/run/systemd/system`` would fake a systemd)."""
    pod = by_kind(objects, "DaemonSet", AGENT)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    bus = PurePosixPath(env["DBUS_SYSTEM_BUS_ADDRESS"].removeprefix("unix:path="))
    for name, needed in (("host-systemd", SYSTEMD_RUN_DIR), ("host-dbus", bus)):
        host_path = volumes[name]["hostPath"]
        assert host_path["type"] == "DirectoryOrCreate"
        # The same path inside as on the host, and what the agent needs lies strictly below.
        assert mounts[name] == {"name": name, "mountPath": host_path["path"], "readOnly": True}
        assert PurePosixPath(needed).parent == PurePosixPath(host_path["path"])
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert not host_paths & {str(SYSTEMD_RUN_DIR), str(bus)}


def test_service_reaches_this_nodes_agent(objects: list[dict[str, Any]]) -> None:
    service = by_kind(objects, "Service", AGENT)
    daemonset = by_kind(objects, "DaemonSet", AGENT)
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    port, metrics = service["spec"]["ports"]
    assert (port["port"], metrics["port"]) == (AGENT_PORT, METRICS_PORT)
    # The URL the spawner helper gives notebooks names exactly this Service.
    namespace = service["metadata"]["namespace"]
    expected = f"http://{service['metadata']['name']}.{namespace}.svc:{AGENT_PORT}"
    assert expected == DEFAULT_K8S_AGENT_URL


def test_network_policy_opens_only_the_api_port(objects: list[dict[str, Any]]) -> None:
    policy = by_kind(objects, "NetworkPolicy", AGENT)
    labels = by_kind(objects, "DaemonSet", AGENT)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    api, metrics = policy["spec"]["ingress"]
    # Notebook namespaces (by label) reach the API; the monitoring namespace the metrics port.
    assert api["ports"] == [{"protocol": "TCP", "port": AGENT_PORT}]
    assert api["from"] == [
        {"namespaceSelector": {"matchLabels": {"gpu-hotplug.jupyter.org/notebooks": "true"}}}
    ]
    assert metrics["ports"] == [{"protocol": "TCP", "port": METRICS_PORT}]
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]


def test_holder_image_is_pulled_and_admitted(objects: list[dict[str, Any]]) -> None:
    """One holder image: the agent's --holder-image, the image the admission policy admits
    from the agent, and the image the init container pre-pulls on every GPU node."""
    pod = by_kind(objects, "DaemonSet", AGENT)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (flag,) = [a for a in container["args"] if a.startswith("--holder-image=")]
    image = flag.partition("=")[2]
    (pull,) = pod["initContainers"]
    assert (pull["image"], pull["command"]) == (image, ["/pause", "-v"])
    policy = by_kind(objects, "ValidatingAdmissionPolicy", POLICY)
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["holderImage"] == f"'{image}'"
    # First: tests/realnode/test_deployed.py patches it by index.
    assert policy["spec"]["variables"][0]["name"] == "holderImage"
    (condition,) = policy["spec"]["matchConditions"]
    assert f"'system:serviceaccount:gpu-hotplug:{AGENT}'" in condition["expression"]
    binding = by_kind(objects, "ValidatingAdmissionPolicyBinding", POLICY)
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }


def test_the_policy_caps_holders_at_the_agents_own_resources(
    objects: list[dict[str, Any]],
) -> None:
    """The policy admits no holder asking for more CPU or memory than the agent's
    --holder-cpu and --holder-memory (issue 31, finding 9)."""
    (container,) = by_kind(objects, "DaemonSet", AGENT)["spec"]["template"]["spec"]["containers"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if "=" in a)
    policy = by_kind(objects, "ValidatingAdmissionPolicy", POLICY)
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["holderCpu"] == f"'{flags['holder-cpu']}'"
    assert variables["holderMemory"] == f"'{flags['holder-memory']}'"


def test_an_overlay_in_another_namespace_keeps_the_policy_on_its_agent(tmp_path: Path) -> None:
    """The policy names the agent by a username that holds its namespace: an overlay that
    moves the agent lists the replacement after its ``namespace:``, and the policy and the
    ClusterRoleBinding follow (a policy naming the old namespace would confine nobody)."""
    shutil.copytree(K8S_DIR, tmp_path / "k8s")
    overlay = tmp_path / "team"
    overlay.mkdir()
    # Inline: kustomize loads no file from outside an overlay's own directory.
    replacement = yaml.safe_load((K8S_DIR / "policy/service-account-namespace.yaml").read_text())
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "gpu-team",
                "resources": ["../k8s"],
                "replacements": [replacement],
            }
        )
    )
    moved = render(overlay)
    assert by_kind(moved, "ServiceAccount", AGENT)["metadata"]["namespace"] == "gpu-team"
    for policy in (POLICY, "gpu-hotplug-holders-agent-only"):
        (condition,) = by_kind(moved, "ValidatingAdmissionPolicy", policy)["spec"][
            "matchConditions"
        ]
        assert f"'system:serviceaccount:gpu-team:{AGENT}'" in condition["expression"]
    (subject,) = by_kind(moved, "ClusterRoleBinding", AGENT)["subjects"]
    assert subject["namespace"] == "gpu-team"


def test_agent_accepts_the_daemonsets_arguments(objects: list[dict[str, Any]]) -> None:
    (container,) = by_kind(objects, "DaemonSet", AGENT)["spec"]["template"]["spec"]["containers"]
    assert agent_config(container["args"])["backend"] == "kubernetes"


def test_cri_o_overlay_moves_the_cri_socket(objects: list[dict[str, Any]]) -> None:
    overlay = render(K8S_DIR / "overlays" / "cri-o")
    for obj in overlay:
        validate(obj)
    pod = by_kind(overlay, "DaemonSet", AGENT)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    cri = [v for v in pod["volumes"] if v["name"] == "cri"]
    assert cri == [{"name": "cri", "hostPath": {"path": "/var/run/crio", "type": "Directory"}}]
    mounts = [m for m in container["volumeMounts"] if m["name"] == "cri"]
    assert mounts == [{"name": "cri", "mountPath": "/var/run/crio", "readOnly": True}]
    endpoints = [a for a in container["args"] if a.startswith("--cri-endpoint=")]
    assert endpoints == ["--cri-endpoint=unix:///var/run/crio/crio.sock"]
    # Everything else is the base's.
    base = {o["kind"] + "/" + o["metadata"]["name"] for o in objects}
    assert {o["kind"] + "/" + o["metadata"]["name"] for o in overlay} == base


def test_the_holder_protection_policy_spares_the_notebook_annotations_only(
    objects: list[dict[str, Any]],
) -> None:
    """Every annotation the product puts on notebook pods (the spawner's, the hub's) is one the
    policy lets anybody write; every holder label and annotation is under the prefix it
    protects (``tests/realnode/test_forgery.py`` proves the policy on a real API server)."""
    policy = by_kind(objects, "ValidatingAdmissionPolicy", "gpu-hotplug-holders-agent-only")
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    prefix = "gpu-hotplug.jupyter.org/"
    assert variables["prefix"] == repr(prefix)
    spared = set(re.findall(r"'([^']+)'", variables["notebookAnnotations"]))
    assert spared == {MAX_GPUS_ANNOTATION, IDLE_RELEASE_ANNOTATION, CONTAINER_ANNOTATION}
    state = [
        value for name, value in vars(holders).items() if name.startswith(("ANNOTATION_", "LABEL_"))
    ]
    assert state and all(key.startswith(prefix) for key in state)
    assert not spared & {v for n, v in vars(holders).items() if n.startswith("ANNOTATION_")}
