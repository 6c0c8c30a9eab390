"""pytest plugin of the real-node tier (registered in ``tests/conftest.py``).

``real_node`` (session, root)
    One ``RealNode`` for the whole session (bring-up costs tens of seconds): the control plane,
    kubelet, containerd 2 and NVIDIA's device plugin with four simulated GPUs. Without the
    built components the tier is skipped with the command that builds them — except where
    ``JGH_REQUIRE_REAL_NODE=1`` (``.ci/test`` sets it), where that is a failure. At the end the
    session fails if teardown had to remove anything by force.
``cluster`` (session)
    ``cluster.Cluster`` over it: namespaces, notebook pods, tokens, exec, PodResources.
``node_agent`` (function)
    The real agent (a subprocess) in Kubernetes mode against the node, authenticated as the
    ``gpu-hotplug-agent`` ServiceAccount with exactly the RBAC that ``k8s/`` ships.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Final

import pytest

from ..fixtures.requirements import ROOT_REASON, has_root_and_cgroups
from .agent import AgentAccount, NodeAgent, install_agent_account, running_node_agent
from .cluster import Cluster
from .components import MissingComponents
from .node import RealNode, new_node

REQUIRE_ENV: Final = "JGH_REQUIRE_REAL_NODE"


@pytest.fixture(scope="session")
def real_node() -> Iterator[RealNode]:
    if not has_root_and_cgroups():
        pytest.skip(ROOT_REASON)
    try:
        node = new_node()
    except MissingComponents as error:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {error}")
        pytest.skip(str(error))
    node.start()
    try:
        yield node
    finally:
        left = node.stop()
        residue = node.residue()
        assert not left, f"the real node left these behind (removed by force): {left}"
        assert not residue, f"still on the host after the node's teardown: {residue}"


@pytest.fixture(scope="session")
def cluster(real_node: RealNode) -> Iterator[Cluster]:
    handle = Cluster(real_node)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(scope="session")
def agent_account(cluster: Cluster) -> AgentAccount:
    return install_agent_account(cluster)


@pytest.fixture
def node_agent(cluster: Cluster, agent_account: AgentAccount) -> Iterator[NodeAgent]:
    with running_node_agent(cluster, agent_account) as agent:
        yield agent
