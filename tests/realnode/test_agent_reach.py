"""What a compromised node's agent can read and do with its own token (issue 31, finding 7).

The agent's token sits in a privileged pod on every GPU node. The admission policy confines its
*writes* to holder pods of its own node (``test_admission_policy.py``); its *reads* RBAC alone
decides, and RBAC cannot scope pods by node: the node-name field selector reaches only the
Node authorizer and webhook authorizers (authorization with selectors, GA in 1.34), and an
authorization webhook is not something this project ships, nor something managed clusters let
you add. So the agent's token reads every pod of the cluster, environment variables included —
KubeSpawner writes ``JUPYTERHUB_API_TOKEN`` into notebook pods' specs. This test pins down
exactly what the token can do, with the token a DaemonSet pod on the node holds, against the
real API server's authorizers; ``docs/operator-guide.md`` ("What the agent may do in the
cluster") states the same table. Should Kubernetes or this project narrow it, the test says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import kubernetes.client as k8s
import pytest

from ..fixtures.requirements import needs_root
from ..k8s.image import PAUSE_IMAGE
from .agent import AgentAccount, agent_token, api_as, node_elsewhere
from .cluster import Cluster

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

ELSEWHERE: Final = "gpu-hotplug-reach-elsewhere"
"""A Node object with no kubelet: another node of the cluster."""

# (verb, group, resource, subresource, namespace) → whether the agent's token may: the table of
# docs/operator-guide.md. "nb" stands for any notebook namespace.
REACH: Final = {
    ("list", "", "pods", "", ""): True,
    ("watch", "", "pods", "", ""): True,
    ("get", "", "pods", "", "kube-system"): True,
    ("create", "", "events", "", "kube-system"): True,
    ("patch", "", "events", "", "kube-system"): True,
    ("create", "authentication.k8s.io", "tokenreviews", "", ""): True,
    ("create", "authorization.k8s.io", "subjectaccessreviews", "", ""): True,
    ("get", "", "secrets", "", "nb"): False,
    ("list", "", "secrets", "", ""): False,
    ("get", "", "configmaps", "", "nb"): False,
    ("create", "", "serviceaccounts", "token", "nb"): False,
    ("create", "", "pods", "exec", "nb"): False,
    ("get", "", "pods", "log", "nb"): False,
    ("patch", "", "nodes", "", ""): False,
    ("get", "", "nodes", "proxy", ""): False,
    ("list", "", "namespaces", "", ""): False,
    ("create", "rbac.authorization.k8s.io", "rolebindings", "", "nb"): False,
    ("update", "", "pods", "ephemeralcontainers", "nb"): False,
}


@pytest.fixture(scope="module")
def elsewhere(cluster: Cluster) -> Iterator[str]:
    with node_elsewhere(cluster, ELSEWHERE) as name:
        yield name


def test_what_the_agents_own_token_may_do_is_the_documented_table(
    cluster: Cluster, agent_account: AgentAccount
) -> None:
    api = api_as(agent_token(cluster, cluster.node_name), cluster)
    authorization: Any = k8s.AuthorizationV1Api(api)
    namespace = cluster.namespace("reach")
    found = {}
    for verb, group, resource, subresource, where in REACH:
        attributes = {"verb": verb, "group": group, "resource": resource}
        if subresource:
            attributes["subresource"] = subresource
        if where:
            attributes["namespace"] = namespace if where == "nb" else where
        review = authorization.create_self_subject_access_review(
            {"spec": {"resourceAttributes": attributes}}
        )
        found[verb, group, resource, subresource, where] = bool(review.status.allowed)
    assert found == REACH


def test_the_agents_token_reads_a_pod_of_another_node_with_its_environment(
    cluster: Cluster, agent_account: AgentAccount, elsewhere: str
) -> None:
    """The limit the operator guide states plainly: RBAC gives the agent every pod."""
    namespace = cluster.namespace("reach-other", pod_security=None)
    cluster.core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "notebook-elsewhere"},
            "spec": {
                "nodeName": elsewhere,
                "containers": [
                    {
                        "name": "notebook",
                        "image": PAUSE_IMAGE,
                        "env": [{"name": "JUPYTERHUB_API_TOKEN", "value": "not-for-the-agent"}],
                    }
                ],
            },
        },
    )
    core: Any = k8s.CoreV1Api(api_as(agent_token(cluster, cluster.node_name), cluster))
    listed = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={elsewhere}")
    (pod,) = [p for p in listed.items if p.metadata.namespace == namespace]
    assert pod.spec.containers[0].env[0].value == "not-for-the-agent"
    cluster.core.delete_namespaced_pod("notebook-elsewhere", namespace, grace_period_seconds=0)
