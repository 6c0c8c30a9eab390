"""pytest plugin of the real-node tier (registered in ``tests/conftest.py``): the fixtures every
test under ``tests/realnode/`` builds on. Their names and interfaces are stable — other test
modules (the Helm chart's, the holder spec's) use them:

``real_node`` (session, root) → ``node.RealNode``
    One real node per test session (bring-up takes tens of seconds): etcd, kube-apiserver,
    kube-controller-manager, kube-scheduler, kube-proxy, a kubelet on containerd 2 + runc, and
    NVIDIA's k8s-device-plugin serving ``nvidia.com/gpu`` from four simulated GPUs (the fake
    ``libnvidia-ml.so.1``). Useful attributes: ``node_name``, ``admin_kubeconfig``,
    ``kubectl(*args)``, ``kubectl_json(*args)``, ``api_client()``, ``cri_endpoint``,
    ``pod_resources_socket``, ``nvml_environ()``, ``nvml_config_path``, ``gpu_count``,
    ``components`` (binaries and ``versions``), ``import_image(archive)``,
    ``restart_kubelet()``, ``log_tail(component)``.
    Without the built components the tier is skipped with the command that builds them,
    except where ``JGH_REQUIRE_REAL_NODE=1`` (``.ci/test`` sets it): then that fails. Only one
    node can run per machine (the kubelet's device-plugin directory is fixed): when another
    session's node is up, the fixture **fails with the reason** (``NodeBusy``: wait and
    retry); a node left by a killed session is removed first. At the end the session fails
    if teardown had to remove anything by force or anything of the node is left on the host.
``cdi_cluster`` (module) → ``cluster.Cluster``
    A node of its own in ``cdi`` mode (``node.NodeMode``: set up as the GPU Operator >= 25.10
    sets a node up — CDI spec, NVIDIA's runtime as a handler, RuntimeClasses, the plugin's
    CDI strategies), for one module. Only one node runs per machine, so tests that use it are
    collected first and their node is down before ``real_node`` starts; do not use both in
    one module.
``cluster`` (session) → ``cluster.Cluster``
    The node as tests use it: ``namespace(prefix, pod_security=...)``,
    ``run_notebook_pod(ns, name, annotations=, resources=, env=)``, ``pod``, ``pods``,
    ``wait_running``, ``delete_pod``, ``gone``, ``holders(ns)``, ``event_reasons``,
    ``pod_token(ns, pod, audience=)`` (a pod-bound token, as the kubelet projects it),
    ``container_id``, ``exec`` (CRI ``ExecSync``), ``open_device``, ``open_fresh_node``,
    ``restart_container``, ``assignments(ns)`` (the kubelet's PodResources ``List``),
    ``kubectl``, ``apply(objects)``; ``core`` is the official client's ``CoreV1Api`` as
    cluster admin. Namespaces are never deleted during a session (the node goes at its end).
``agent_account`` (session) → ``agent.AgentAccount``
    The agent's Namespace, ServiceAccount and RBAC applied from ``k8s/`` and a kubeconfig
    with a token of that ServiceAccount.
``vm_node`` (module) → ``vm_node.VmNode``
    The production node (cgroup v2, systemd, the kubelet's ``systemd`` cgroup driver) in a qemu
    VM, joined to ``cluster`` as a second node with two simulated GPUs of its own, for one
    module (other modules see a one-node cluster). Its tests log one line per node (kubelet,
    containerd, cgroup version, driver). Skipped or failed as ``real_node`` is when the VM
    tier's tools or image are missing.
``node_agent`` (function) → ``agent.NodeAgent``
    The real agent (a subprocess) in Kubernetes mode against the node as that ServiceAccount;
    ``as_pod(ns, pod)`` is an API client carrying the pod's bound token (audience
    ``gpu-hotplug``); ``process`` is the ``AgentProcess`` (kill -9, restart, log). For other
    arguments use ``agent.running_node_agent(cluster, agent_account, extra=(...))``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Final, NoReturn

import pytest

from ..fixtures.requirements import ROOT_REASON, has_root_and_cgroups
from .agent import AgentAccount, NodeAgent, install_agent_account, running_node_agent
from .cluster import Cluster
from .components import ContainerToolkit, MissingComponents, find_container_toolkit
from .node import NodeBusy, NodeMode, RealNode, new_node
from .vm_node import VmNode, running_vm_node

REQUIRE_ENV: Final = "JGH_REQUIRE_REAL_NODE"
CDI_FIXTURE: Final = "cdi_cluster"


def absent(reason: str) -> NoReturn:
    """Skip for want of root or the built components, or fail where ``JGH_REQUIRE_REAL_NODE=1``
    (CI, where they must be there)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(reason)


def required_container_toolkit() -> ContainerToolkit:
    """NVIDIA Container Toolkit for a test that runs it without a node (as root); skipped or
    failed as ``real_node`` is when it is not built."""
    if not has_root_and_cgroups():
        absent(ROOT_REASON)
    try:
        return find_container_toolkit()
    except MissingComponents as error:
        absent(str(error))


def _running_node(mode: NodeMode) -> Iterator[RealNode]:
    """A started node of ``mode`` until the generator is closed; then it is stopped and the
    test fails if anything had to be removed by force or is left on the host."""
    if not has_root_and_cgroups():
        absent(ROOT_REASON)
    try:
        node = new_node(mode=mode)
    except MissingComponents as error:
        absent(str(error))
    busy = None
    try:
        node.start()
    except NodeBusy as error:
        busy = str(error)
    if busy is not None:  # failed outside the handler: the reason alone, once
        pytest.fail(busy, pytrace=False)
    try:
        yield node
    finally:
        left = node.stop()
        residue = node.residue()
        assert not left, f"the real node left these behind (removed by force): {left}"
        assert not residue, f"still on the host after the node's teardown: {residue}"


@pytest.fixture(scope="session")
def real_node() -> Iterator[RealNode]:
    yield from _running_node("plain")


@pytest.fixture(scope="session")
def cluster(real_node: RealNode) -> Iterator[Cluster]:
    handle = Cluster(real_node)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(scope="module")
def cdi_cluster() -> Iterator[Cluster]:
    """A node of its own in ``cdi`` mode for one module (see the module docstring)."""
    for node in _running_node("cdi"):
        handle = Cluster(node)
        try:
            yield handle
        finally:
            handle.close()


NODE_FIXTURES: Final = frozenset({"real_node", CDI_FIXTURE})


def _lane_order(item: pytest.Item) -> int:
    """Where a test runs in the real-node lane (stable otherwise).

    0. Tests on no node: most need at most Helm, which ``build.sh`` makes first, so they run
       while a cold build makes the rest (``.ci/test`` starts the lane's tests beside it); the
       CDI spec's tests wait for the Container Toolkit, which the ``cdi`` node needs anyway.
    1. Tests on ``cdi_cluster``: one node per machine, so its module's node must be down before
       the session's ``real_node`` comes up, and it is (a module fixture ends with its module).
    2. Tests on the session's node.
    3. ``built_last``: promtool's, the build's last component, at the lane's end."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if item.get_closest_marker("built_last"):
        return 3
    if CDI_FIXTURE in fixtures:
        return 1
    return 2 if NODE_FIXTURES & fixtures else 0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test on a node is in the ``realnode`` lane (``.ci/test`` runs that lane apart, and
    only it may start the one node a machine can run), marked here before ``-m`` selects; the
    lane's order is ``_lane_order``'s."""
    for item in items:
        if NODE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.realnode)
    items.sort(key=_lane_order)


@pytest.fixture(scope="session")
def agent_account(cluster: Cluster) -> AgentAccount:
    return install_agent_account(cluster)


@pytest.fixture
def node_agent(cluster: Cluster, agent_account: AgentAccount) -> Iterator[NodeAgent]:
    with running_node_agent(cluster, agent_account) as agent:
        yield agent


@pytest.fixture(scope="module")
def vm_node(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[VmNode]:
    from ..vm.image import missing_host_tools

    if missing := missing_host_tools():
        absent(f"the VM node needs {missing}: run `bash .ci/setup --with-vm`")
    with running_vm_node(cluster.node) as node:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        for line in node.describe_nodes():
            if reporter is not None:
                reporter.write_line(line)
        yield node
