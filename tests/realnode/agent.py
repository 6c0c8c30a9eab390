"""The real agent (a subprocess, Kubernetes mode) on the real node, as the ServiceAccount that
``k8s/`` deploys it as, with exactly the RBAC that ``k8s/`` ships.

Why a subprocess here and a DaemonSet pod only in ``test_deployed.py``: the scenarios need to
kill, restart and read the agent's log; the deployment test proves the manifests themselves.
The account is rendered from ``kubectl kustomize k8s/`` (the Namespace, ServiceAccount and RBAC
objects only), so a rule the agent needs and the manifests lack fails here, on a real
authorizer.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import kubernetes.client as k8s

from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec, holder_pod

from ..agent.agent_process import AgentProcess
from ..agent.api_harness import ApiClient
from ..fixtures.agent import kubernetes_agent_argv
from ..k8s.image import PAUSE_IMAGE
from ..manifests.support import render, with_holder_image
from .cluster import Cluster
from .pki import write_kubeconfig

AGENT_NAMESPACE: Final = "gpu-hotplug"
AGENT_ACCOUNT: Final = "gpu-hotplug-agent"
RBAC_KINDS: Final = frozenset(
    {
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "PriorityClass",
    }
)
"""What the subprocess agent needs of the manifests (not the DaemonSet, Service, policy)."""
RECONCILE_INTERVAL: Final = 1.0


@dataclass(frozen=True)
class AgentAccount:
    """The agent's identity on the node: a kubeconfig with a token of its ServiceAccount."""

    kubeconfig: Path


def install_agent_account(cluster: Cluster) -> AgentAccount:
    """Apply the agent's Namespace, ServiceAccount, RBAC and admission policy from ``k8s/``
    (holders from the test's pause image); mint a token bound to a pod on the node."""
    objects = [with_holder_image(o, PAUSE_IMAGE) for o in render() if o["kind"] in RBAC_KINDS]
    cluster.apply(objects)
    token = agent_token(cluster, cluster.node_name)
    directory = Path(tempfile.mkdtemp(prefix="jgh-agent-account-", dir="/tmp"))
    assert cluster.node.pki is not None
    kubeconfig = write_kubeconfig(
        directory / "agent.kubeconfig", cluster.node.apiserver_url, cluster.node.pki.ca.cert, token
    )
    return AgentAccount(kubeconfig)


def agent_token(cluster: Cluster, node: str, *, seconds: int = 6 * 3600) -> str:
    """A token of the agent's ServiceAccount as its DaemonSet pod on ``node`` holds it: bound
    to a pod there, so it names the node (``authentication.kubernetes.io/node-name``), which
    the admission policy requires. The pod is a stand-in (the pause image) for the DaemonSet's;
    ``node`` may be a Node object without a kubelet."""
    name = f"{AGENT_ACCOUNT}-on-{node}"[:63].rstrip("-.")
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": AGENT_NAMESPACE},
            "spec": {
                "serviceAccountName": AGENT_ACCOUNT,
                "automountServiceAccountToken": False,
                "nodeName": node,
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {"name": "identity", "image": PAUSE_IMAGE, "imagePullPolicy": "Never"}
                ],
            },
        }
    )
    return cluster.kubectl(
        "create", "token", AGENT_ACCOUNT, "-n", AGENT_NAMESPACE, f"--duration={seconds}s",
        "--bound-object-kind=Pod", f"--bound-object-name={name}",
    ).strip()  # fmt: skip


@contextlib.contextmanager
def node_elsewhere(cluster: Cluster, name: str) -> Iterator[str]:
    """A Node object with no kubelet behind it: another node of the cluster, where an agent's
    token may be bound or a pod placed (it never runs)."""
    cluster.core.create_node({"metadata": {"name": name}})
    try:
        yield name
    finally:
        cluster.core.delete_node(name)


def holder_as_the_agent_builds_it(
    cluster: Cluster, notebook: dict[str, Any], index: int, node: str | None = None
) -> dict[str, Any]:
    """A holder for ``notebook``'s container as the agent builds it (the test's pause image is
    the holder image), pinned to ``node`` (default: the host's node)."""
    namespace, name = notebook["metadata"]["namespace"], notebook["metadata"]["name"]
    return holder_pod(
        notebook,
        container="notebook",
        container_id=cluster.container_id(namespace, name),
        request_id=None,
        index=index,
        spec=HolderSpec(node_name=node or cluster.node_name, image=PAUSE_IMAGE),
    )


def api_as(token: str, cluster: Cluster) -> k8s.ApiClient:
    """An API client of the cluster that authenticates with ``token`` (and nothing else)."""
    configuration = k8s.Configuration()
    admin = cluster.api.configuration
    configuration.host = admin.host
    configuration.ssl_ca_cert = admin.ssl_ca_cert
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return k8s.ApiClient(configuration)


@dataclass
class NodeAgent:
    """A running agent: its process and the cluster it serves."""

    process: AgentProcess
    cluster: Cluster

    def as_pod(self, namespace: str, pod: str) -> ApiClient:
        """The API as the pod's own bound token (audience gpu-hotplug) calls it."""
        assert self.process.tcp is not None
        return self.process.tcp.with_token(self.cluster.pod_token(namespace, pod))

    def log(self) -> str:
        return self.process.log()


def agent_argv(
    cluster: Cluster, account: AgentAccount, state_dir: Path, socket: Path, extra: tuple[str, ...]
) -> list[str]:
    """The agent's command line: as deployed, but that a pod without the ``max-gpus``
    annotation may take every GPU of the node (the scenarios attach several to plain pods;
    ``test_limits`` gives ``--default-max-gpus`` itself). Namespaces are allowed as deployed:
    by the label ``cluster.namespace`` puts on them."""
    limit = (
        ()
        if any(arg.startswith("--default-max-gpus") for arg in extra)
        else (f"--default-max-gpus={cluster.node.gpu_count}",)
    )
    return kubernetes_agent_argv(
        node_name=cluster.node_name,
        kubeconfig=account.kubeconfig,
        pod_resources_socket=cluster.node.pod_resources_socket,
        cri_endpoint=cluster.node.cri_endpoint,
        state_dir=state_dir,
        socket_path=socket,
        reconcile_interval=RECONCILE_INTERVAL,
        extra=(f"--holder-image={PAUSE_IMAGE}", *limit, *extra),
    )


@contextlib.contextmanager
def running_node_agent(
    cluster: Cluster, account: AgentAccount, *, extra: tuple[str, ...] = ()
) -> Iterator[NodeAgent]:
    """The agent for the node, running; stopped on exit, its log printed (pytest shows it
    for a failing test), its directory removed."""
    directory = Path(tempfile.mkdtemp(prefix="jgh-nagent-", dir="/tmp"))
    state_dir = directory / "state"
    process = AgentProcess(state_dir=state_dir, simulate=0, env=cluster.node.nvml_environ())
    # In the node's driver namespace, as NVIDIA's plugin: the MIG tables are where a node's are.
    process.argv = cluster.node.in_driver_namespace(
        agent_argv(cluster, account, state_dir, process.socket_path, extra)
    )
    process.start()
    try:
        yield NodeAgent(process, cluster)
    finally:
        process.stop()
        print(process.log()[-8000:])
        shutil.rmtree(directory, ignore_errors=True)
