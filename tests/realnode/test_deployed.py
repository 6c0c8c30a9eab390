"""The agent as it is deployed (``deployment.py``: the image built from this repository,
``kubectl apply -k`` of an overlay over ``k8s/`` — the DaemonSet, its RBAC, probes and host
mounts on the real node) and a notebook pod that attaches a GPU through the node-local Service
with its projected token, as the server extension does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..fixtures.requirements import needs_root
from . import deployment
from .cluster import Cluster
from .service_calls import attach_and_detach_through_the_service

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]


@pytest.fixture
def deployed_agent(cluster: Cluster) -> Iterator[str]:
    """The agent's DaemonSet (``deployment.deployed_agent``); yields its Service's ClusterIP."""
    with deployment.deployed_agent(cluster) as service_ip:
        yield service_ip


def test_the_deployed_agent_attaches_through_the_node_local_service(
    cluster: Cluster, deployed_agent: str
) -> None:
    attach_and_detach_through_the_service(cluster, cluster.namespace("deployed"), deployed_agent)
