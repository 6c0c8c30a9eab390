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
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..agent.agent_process import AgentProcess
from ..agent.api_harness import ApiClient
from ..k8s.image import PAUSE_IMAGE
from ..manifests.support import render
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
    """Apply the agent's Namespace, ServiceAccount and RBAC from ``k8s/``; mint a token."""
    objects = [o for o in render() if o["kind"] in RBAC_KINDS]
    cluster.apply(objects)
    token = cluster.kubectl(
        "create", "token", AGENT_ACCOUNT, "-n", AGENT_NAMESPACE, "--duration=6h"
    ).strip()
    directory = Path(tempfile.mkdtemp(prefix="jgh-agent-account-", dir="/tmp"))
    assert cluster.node.pki is not None
    kubeconfig = write_kubeconfig(
        directory / "agent.kubeconfig", cluster.node.apiserver_url, cluster.node.pki.ca.cert, token
    )
    return AgentAccount(kubeconfig)


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
    return [
        sys.executable,
        "-m",
        "jupyter_gpu_hotplug.agent.app",
        "--backend=kubernetes",
        f"--node-name={cluster.node_name}",
        f"--kubeconfig={account.kubeconfig}",
        f"--pod-resources-socket={cluster.node.pod_resources_socket}",
        f"--cri-endpoint={cluster.node.cri_endpoint}",
        f"--state-dir={state_dir}",
        f"--holder-image={PAUSE_IMAGE}",
        f"--reconcile-interval={RECONCILE_INTERVAL}",
        "--listen=127.0.0.1:0",
        f"--listen=unix:{socket}",
        *extra,
    ]


@contextlib.contextmanager
def running_node_agent(
    cluster: Cluster, account: AgentAccount, *, extra: tuple[str, ...] = ()
) -> Iterator[NodeAgent]:
    """The agent for the node, running; stopped on exit, its log printed (pytest shows it
    for a failing test), its directory removed."""
    directory = Path(tempfile.mkdtemp(prefix="jgh-nagent-", dir="/tmp"))
    state_dir = directory / "state"
    process = AgentProcess(state_dir=state_dir, simulate=0, env=cluster.node.nvml_environ())
    process.argv = agent_argv(cluster, account, state_dir, process.socket_path, extra)
    process.start()
    try:
        yield NodeAgent(process, cluster)
    finally:
        process.stop()
        print(process.log()[-8000:])
        shutil.rmtree(directory, ignore_errors=True)
