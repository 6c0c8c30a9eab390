"""``helm install`` of the chart on the real node brings the agent up, and a notebook pod attaches
a GPU through the node-local Service, as ``test_deployed.py`` proves for kustomize.

The values change only what differs on this node from a cloud's GPU node, as that test's
overlay does: the image (built by ``image/build.sh``, imported, never pulled, and named by its
digest, ``image.digest``: what a signed-image policy pins), no ``nvidia
RuntimeClass, where this kubelet and containerd keep their sockets, the simulated NVML mounted
from the host (``agent.extraEnv``/``extraVolumes``), and the test's pause image as the holder
image (the admission policy then admits it). The release lives in a namespace of its own; its
cluster-wide objects (ClusterRoles, PriorityClasses, the admission policy) share their names
with those the session's ``agent_account`` applied, so the install takes them over and the
teardown applies the session's again.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import kubernetes.client as k8s
import pytest

from ..fixtures.commands import run_checked
from ..fixtures.requirements import needs_root
from ..image.agent_image import BUILD_TIMEOUT
from ..k8s.image import PAUSE_IMAGE
from ..manifests.support import CHART_DIR, helm, render, with_holder_image
from . import deployment
from .agent import RBAC_KINDS, AgentAccount
from .agent_image import agent_image
from .cluster import Cluster
from .service_calls import attach_and_detach_through_the_service

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

RELEASE: Final = "gpu-hotplug-chart"
NAMESPACE: Final = "gpu-hotplug-chart"
NOTEBOOKS_LABEL: Final = "gpu-hotplug.jupyter.org/notebooks"


def _by_digest(cluster: Cluster) -> tuple[str, str]:
    """The imported agent image's repository and manifest digest, with the digest reference
    recorded in containerd as a pull by digest records it (``ctr images import`` records only
    the tag; the kubelet resolves ``repository@digest`` among the runtime's image names)."""
    name = agent_image().name
    (line,) = [
        row for row in cluster.node.ctr("images", "ls").splitlines() if row.split()[0] == name
    ]
    digest = line.split()[2]
    assert digest.startswith("sha256:"), line
    repository = name.rpartition(":")[0]
    cluster.node.ctr("images", "tag", "--force", name, f"{repository}@{digest}")
    return repository, digest


def _values(cluster: Cluster) -> dict[str, Any]:
    node = cluster.node
    repository, digest = _by_digest(cluster)
    nvml = deployment.fake_nvml_mounts(node)
    return {
        # A tag that does not exist: the digest wins.
        "image": {"repository": repository, "tag": "not-this-tag", "digest": digest,
                  "pullPolicy": "Never"},
        "runtimeClassName": "",
        "cri": {"socketDir": str(node.containerd_dir), "endpoint": node.cri_endpoint},
        "kubelet": {"podResourcesDir": str(node.pod_resources_socket.parent)},
        "holder": {
            "image": PAUSE_IMAGE,
            "pullPolicy": "Never",
            # busybox's sleep stands in for `pause -v`.
            "prepullCommand": ["/bin/sleep", "0"],
        },
        # busybox-static notebooks: nothing to load (test_cdi_attach.py proves the CDI path).
        "driverFiles": {"mode": "off"},
        "agent": {
            "extraEnv": nvml.env,
            "extraVolumes": nvml.volumes,
            "extraVolumeMounts": nvml.mounts,
        },
    }  # fmt: skip


def _helm(cluster: Cluster, *args: str) -> str:
    argv = [helm(), "--kubeconfig", str(cluster.node.admin_kubeconfig), *args]
    return run_checked(argv, timeout=600, what=f"helm {args[0]}").stdout


@pytest.fixture
def installed(cluster: Cluster, agent_account: AgentAccount) -> Iterator[str]:
    """The release, installed; yields the Service's ClusterIP once the agent pod is Ready."""
    cluster.node.import_image(agent_image().archive)
    cluster.kubectl("label", "node", cluster.node_name, f"{deployment.GPU_NODE_LABEL}=true",
                    "--overwrite")  # fmt: skip
    cluster.core.create_namespace(
        {"metadata": {"name": NAMESPACE,
                      "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}}
    )  # fmt: skip
    directory = Path(tempfile.mkdtemp(prefix="jgh-chart-", dir="/tmp"))
    values = directory / "values.json"
    values.write_text(json.dumps(_values(cluster)))
    try:
        _helm(cluster, "install", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE,
              "--values", str(values), "--take-ownership", "--timeout", "300s")  # fmt: skip
        yield deployment.agent_service_when_ready(cluster, NAMESPACE, "the chart's agent pod")
    finally:
        deployment.print_agent_log(cluster, NAMESPACE)
        _helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait")
        cluster.kubectl("label", "node", cluster.node_name, f"{deployment.GPU_NODE_LABEL}-",
                        check=False)  # fmt: skip
        # The session's agent account: its cluster-wide objects again (the install took them).
        cluster.apply(
            [with_holder_image(o, PAUSE_IMAGE) for o in render() if o["kind"] in RBAC_KINDS]
        )


# The fixture builds the image (minutes on a cold cache) before the install's own waits.
@pytest.mark.timeout(BUILD_TIMEOUT + 900)
def test_helm_install_brings_the_agent_up_and_a_notebook_attaches(
    cluster: Cluster, installed: str
) -> None:
    # The agent's NetworkPolicy admits notebook namespaces by this label.
    namespace = cluster.namespace("chart")
    cluster.kubectl("label", "namespace", namespace, f"{NOTEBOOKS_LABEL}=true")
    admission: Any = k8s.AdmissionregistrationV1Api(cluster.api)
    policy = cluster.api.sanitize_for_serialization(
        admission.read_validating_admission_policy("gpu-hotplug-agent-holders-only")
    )
    # The release's policy names the release's ServiceAccount.
    assert f"system:serviceaccount:{NAMESPACE}:gpu-hotplug-agent" in json.dumps(policy)
    # The agent runs the image named by its digest.
    daemonset: Any = cluster.api.sanitize_for_serialization(
        k8s.AppsV1Api(cluster.api).read_namespaced_daemon_set("gpu-hotplug-agent", NAMESPACE)
    )
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert "@sha256:" in container["image"]
    attach_and_detach_through_the_service(cluster, namespace, installed)
