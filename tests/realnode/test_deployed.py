"""The agent as it is deployed: the image built from this repository (no registry), imported
into the node's containerd, ``kubectl apply -k`` of an overlay over ``k8s/`` — the DaemonSet,
its RBAC, probes and host mounts on the real node — and a notebook pod that attaches a GPU
through the node-local Service with its projected token, as the server extension does.

The overlay changes only what differs on this node from a GPU node of a cloud: the image (local,
``imagePullPolicy: Never``), no ``nvidia`` RuntimeClass (no NVIDIA container toolkit here: the
simulated NVML is mounted instead, from the host), and where this kubelet and containerd keep
their sockets. Everything else — privileges, ``hostPID``, probes, the ServiceAccount and its
RBAC, the Service's ``internalTrafficPolicy: Local`` — is what ``k8s/`` ships.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from jupyter_gpu_hotplug.nvml.sim import CONFIG_ENV

from ..fixtures.requirements import needs_root
from ..k8s.image import PAUSE_IMAGE, TOOLS_IMAGE
from ..manifests.support import K8S_DIR, render
from .agent import AGENT_NAMESPACE
from .agent_image import AgentImage, agent_image
from .cluster import Cluster, eventually
from .node import RealNode

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

GPU_NODE_LABEL: Final = "nvidia.com/gpu.present"
TOKEN_PATH: Final = "/var/run/secrets/gpu-hotplug/token"
REQUEST_TIMEOUT: Final = 120
"""Seconds an attach or detach from inside the notebook may take (its holder's start)."""
HOST_STATE_DIR: Final = Path("/run/gpu-hotplug")
"""The DaemonSet's state directory on the host (``hostPath``, ``DirectoryOrCreate``)."""


@dataclass(frozen=True)
class FakeNvmlMounts:
    """The node's simulated NVML, mounted into the agent's pod from the host (there is no
    NVIDIA container toolkit here): its environment, volumes and volume mounts."""

    env: list[dict[str, str]]
    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]


def fake_nvml_mounts(node: RealNode) -> FakeNvmlMounts:
    assert node.nvml_library_dir is not None and node.nvml_config_path is not None
    return FakeNvmlMounts(
        env=[
            {"name": "LD_LIBRARY_PATH", "value": str(node.nvml_library_dir)},
            {"name": CONFIG_ENV, "value": str(node.nvml_config_path)},
        ],
        volumes=[
            {"name": "fake-nvml",
             "hostPath": {"path": str(node.nvml_library_dir), "type": "Directory"}},
            {"name": "fake-nvml-config",
             "hostPath": {"path": str(node.nvml_config_path), "type": "File"}},
        ],
        mounts=[
            {"name": "fake-nvml", "mountPath": str(node.nvml_library_dir), "readOnly": True},
            {"name": "fake-nvml-config", "mountPath": str(node.nvml_config_path),
             "readOnly": True},
        ],
    )  # fmt: skip


def _agent_patch(cluster: Cluster, image: AgentImage) -> dict[str, Any]:
    """A strategic-merge patch of the shipped DaemonSet for this node (see the module doc)."""
    (daemonset,) = [o for o in render() if o["kind"] == "DaemonSet"]
    (container,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "agent"]  # fmt: skip
    node = cluster.node
    nvml = fake_nvml_mounts(node)
    replaced = {
        "--pod-resources-socket": str(node.pod_resources_socket),
        "--cri-endpoint": node.cri_endpoint,
        "--holder-image": PAUSE_IMAGE,
        # The notebook here is busybox-static: no loader, no driver to give it. The driver's
        # files from the node's CDI spec are proven by test_cdi_attach.py.
        "--driver-files": "off",
    }
    args = [
        f"{arg.partition('=')[0]}={replaced[arg.partition('=')[0]]}"
        if arg.partition("=")[0] in replaced
        else arg
        for arg in container["args"]
    ]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": daemonset["metadata"]["name"], "namespace": AGENT_NAMESPACE},
        "spec": {
            "template": {
                "spec": {
                    "runtimeClassName": None,
                    # The pre-pull of the holder image: here the test's pause image, which is
                    # imported, not pulled (busybox's sleep stands in for `pause -v`).
                    "initContainers": [
                        {"name": "pull-holder-image", "image": PAUSE_IMAGE,
                         "imagePullPolicy": "Never", "command": ["/bin/sleep", "0"]}
                    ],
                    "containers": [
                        {
                            "name": "agent",
                            "image": image.name,
                            "imagePullPolicy": "Never",
                            "args": args,
                            "env": nvml.env,
                            "volumeMounts": [
                                {"name": "pod-resources",
                                 "mountPath": str(node.pod_resources_socket.parent)},
                                {"name": "cri", "mountPath": str(node.containerd_dir)},
                                *nvml.mounts,
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "pod-resources",
                         "hostPath": {"path": str(node.pod_resources_socket.parent)}},
                        {"name": "cri", "hostPath": {"path": str(node.containerd_dir)}},
                        *nvml.volumes,
                    ],
                }
            }
        },
    }  # fmt: skip


def agent_service_when_ready(cluster: Cluster, namespace: str, what: str) -> str:
    """Wait until the agent's DaemonSet pod in ``namespace`` is Ready (its readiness probe
    passes, ``what`` says whose); then the ClusterIP of its Service."""

    def ready() -> bool:
        pods = cluster.pods(namespace, "app.kubernetes.io/name=gpu-hotplug-agent")
        return any(
            all(s.get("ready") for s in (p["status"].get("containerStatuses") or [{}]))
            for p in pods
        )

    eventually(ready, f"{what} is Ready (its readiness probe passes)", 300)
    service = cluster.core.read_namespaced_service("gpu-hotplug-agent", namespace)
    return str(service.spec.cluster_ip)


def print_agent_log(cluster: Cluster, namespace: str) -> None:
    """The agent's last log lines, for a failed test's output."""
    print(cluster.kubectl("logs", "-n", namespace, "daemonset/gpu-hotplug-agent",
                          "--tail=200", check=False))  # fmt: skip


@pytest.fixture
def deployed_agent(cluster: Cluster) -> Iterator[str]:
    """``kubectl apply -k`` of the overlay; yields the Service's ClusterIP once the agent's
    pod is Ready; deletes everything it applied at the end."""
    image = agent_image()
    cluster.node.import_image(image.archive)
    had_state_dir = HOST_STATE_DIR.exists()
    cluster.kubectl("label", "node", cluster.node_name, f"{GPU_NODE_LABEL}=true", "--overwrite")
    overlay = Path(tempfile.mkdtemp(prefix="jgh-overlay-", dir="/tmp"))
    (overlay / "agent-patch.json").write_text(json.dumps(_agent_patch(cluster, image)))
    # The admission policy admits holders of the holder image only: the test's pause image.
    # (tests/manifests checks that variables[0] is holderImage.)
    policy_patch = [{"op": "replace", "path": "/spec/variables/0/expression",
                     "value": f"'{PAUSE_IMAGE}'"}]  # fmt: skip
    (overlay / "policy-patch.json").write_text(json.dumps(policy_patch))
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(K8S_DIR, overlay)}\n"
        "patches:\n  - path: agent-patch.json\n"
        "  - path: policy-patch.json\n"
        "    target: {kind: ValidatingAdmissionPolicy, name: gpu-hotplug-agent-holders-only}\n"
    )
    try:
        # The cluster-wide objects are the session's too (``agent_account``, applied client-side
        # and re-applied after the chart's release): the overlay takes over their fields.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(overlay))
        yield agent_service_when_ready(cluster, AGENT_NAMESPACE, "the agent's DaemonSet pod")
    finally:
        print_agent_log(cluster, AGENT_NAMESPACE)
        # The agent's workload only: its Namespace, ServiceAccount and RBAC are the session's
        # (``agent_account``), which later tests still use.
        cluster.kubectl("delete", "-n", AGENT_NAMESPACE, "daemonset/gpu-hotplug-agent",
                        "service/gpu-hotplug-agent", "--wait=true", "--timeout=120s",
                        check=False)  # fmt: skip
        eventually(
            lambda: not cluster.pods(AGENT_NAMESPACE, "app.kubernetes.io/name=gpu-hotplug-agent"),
            "the agent's pod is gone",
        )
        cluster.kubectl("label", "node", cluster.node_name, f"{GPU_NODE_LABEL}-", check=False)
        shutil.rmtree(overlay, ignore_errors=True)
        if not had_state_dir:  # the DaemonSet's hostPath (DirectoryOrCreate) made it
            shutil.rmtree(HOST_STATE_DIR, ignore_errors=True)


def _notebook_with_token(name: str) -> dict[str, Any]:
    """A notebook pod as the spawner makes it: a projected token for the agent's audience."""
    return {
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "notebook",
                    "image": TOOLS_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "infinity"],
                    "volumeMounts": [
                        {"name": "gpu-hotplug-token", "mountPath": str(Path(TOKEN_PATH).parent)}
                    ],
                }
            ],
            "volumes": [
                {
                    "name": "gpu-hotplug-token",
                    "projected": {
                        "sources": [
                            {
                                "serviceAccountToken": {
                                    "audience": "gpu-hotplug",
                                    "expirationSeconds": 3600,
                                    "path": Path(TOKEN_PATH).name,
                                }
                            }
                        ]
                    },
                }
            ],
        },
    }


def test_the_deployed_agent_attaches_through_the_node_local_service(
    cluster: Cluster, deployed_agent: str
) -> None:
    attach_and_detach_through_the_service(cluster, cluster.namespace("deployed"), deployed_agent)


def _agent_call(
    cluster: Cluster, ns: str, service_ip: str, method: str, body: str | None = None
) -> tuple[int, str]:
    """``method /v1/attachments`` from inside the notebook pod ``nb`` with its projected token;
    returns the status and the body, so that a refusal shows the agent's own words (status 0:
    no answer, while the Service has no endpoint yet).

    Written out for busybox's ``nc`` (its ``wget`` knows no DELETE and hides an error's body).
    The request is written by ``nc -e``'s program, which then copies the answer to stderr: a
    plain ``printf | nc`` half-closes the connection when its input ends, and tornado takes
    that for the caller going away (the answer is then dropped)."""
    request = f"{method} /v1/attachments HTTP/1.0\\r\\nAuthorization: Bearer %s\\r\\n"
    if body is not None:
        request += f"Content-Type: application/json\\r\\nContent-Length: {len(body)}\\r\\n"
    request += "\\r\\n" + (body or "")  # printf's format: no '%' in the body
    program = f'printf "$1" "$(cat {TOKEN_PATH})"; cat >&2'
    argv = ["nc", "-w", str(REQUEST_TIMEOUT), service_ip, "8477",
            "-e", "/bin/sh", "-c", program, "sh", request]  # fmt: skip
    answer = cluster.exec(ns, "nb", argv, timeout=REQUEST_TIMEOUT + 10)
    status_line, _, rest = answer.stderr.partition("\r\n")
    if not status_line.startswith("HTTP/"):
        return 0, f"no HTTP answer: {answer}"
    return int(status_line.split()[1]), rest.partition("\r\n\r\n")[2]


def attach_and_detach_through_the_service(cluster: Cluster, ns: str, service_ip: str) -> None:
    """A notebook pod in ``ns`` attaches a GPU through the agent's Service at ``service_ip``
    with its projected token, opens it, and detaches (also the Helm chart's test)."""
    cluster.core.create_namespaced_pod(ns, _notebook_with_token("nb"))
    cluster.wait_running(ns, "nb")
    answers: list[tuple[int, str]] = []

    def attach() -> dict[str, Any] | None:
        # Retried while the Service has no endpoint yet (nc gets no answer) or the agent says
        # the refusal is temporary; anything else fails at once with the agent's answer.
        status, body = _agent_call(cluster, ns, service_ip, "POST", '{"count": 1}')
        answers.append((status, body))
        if status == 201:
            created: dict[str, Any] = json.loads(body)
            return created
        assert status == 0 or json.loads(body).get("retryable"), answers
        return None

    try:
        created = eventually(attach, "an attach through the Service")
    except AssertionError as e:
        raise AssertionError(f"{e}; the agent's last answers: {answers[-3:]}") from e
    (attachment,) = created["attachments"]
    assert attachment["target"]["pod"] == {"namespace": ns, "name": "nb", "container": "notebook"}
    opened = cluster.exec(ns, "nb", ["cat", f"/dev/nvidia{attachment['minor']}"])
    assert "No such device or address" in opened.stdout + opened.stderr
    (holder,) = cluster.holders(ns)
    assert holder["status"]["phase"] == "Running"
    status, body = _agent_call(cluster, ns, service_ip, "DELETE")
    assert status == 204, body
    eventually(lambda: cluster.holders(ns) == [], "the detach through the Service frees the GPU")
