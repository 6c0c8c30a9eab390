"""The chart's ``rbacScope: namespaces`` on the real API server (issue 31, finding 7): the
narrowest RBAC can do, since it cannot scope the agent's reads by node.

The session's agent ServiceAccount is given the chart's namespaced RBAC for the test's notebook
namespace — the cluster-wide ClusterRole keeps TokenReview, SubjectAccessReview and
RuntimeClasses; pods, their finalizers and Events come from a RoleBinding there — and an agent
started with ``--rbac-scope=namespaces`` serves a notebook of that namespace (its node view lists
and watches that namespace alone), while the same token is refused the pods of any other
namespace, ``kube-system`` included. The session's RBAC is put back afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import kubernetes.client as k8s
import pytest
from kubernetes.client.exceptions import ApiException

from ..fixtures.device_messages import ENXIO, EPERM
from ..fixtures.requirements import needs_root
from ..manifests.support import by_kind, render, render_chart
from .agent import AgentAccount, agent_token, api_as, running_node_agent
from .cluster import Cluster, eventually

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

AGENT: Final = "gpu-hotplug-agent"
PODS_ROLE: Final = f"{AGENT}-pods"


@pytest.fixture
def namespaced(cluster: Cluster, agent_account: AgentAccount) -> Iterator[str]:
    """A notebook namespace, and the agent's RBAC as the chart renders ``rbacScope:
    namespaces`` for it; the session's cluster-wide RBAC is restored afterwards."""
    namespace = cluster.namespace("nsrbac")
    chart = render_chart(
        "rbacScope=namespaces", f'allowedNamespaces=["{namespace}"]', "allowedNamespaceSelector="
    )
    cluster.apply(
        [
            by_kind(chart, "ClusterRole", AGENT),
            by_kind(chart, "ClusterRole", PODS_ROLE),
            by_kind(chart, "RoleBinding", AGENT),
        ]
    )
    try:
        yield namespace
    finally:
        cluster.apply([by_kind(render(), "ClusterRole", AGENT)])
        cluster.kubectl("delete", "rolebinding", AGENT, "-n", namespace)
        cluster.kubectl("delete", "clusterrole", PODS_ROLE)


def _forbidden(call: Any) -> None:
    with pytest.raises(ApiException) as refused:
        call()
    assert refused.value.status == 403, refused.value.body


def test_an_agent_with_namespaced_rbac_serves_its_namespace_and_reads_no_other(
    cluster: Cluster, agent_account: AgentAccount, namespaced: str
) -> None:
    core: Any = k8s.CoreV1Api(api_as(agent_token(cluster, cluster.node_name), cluster))
    # RBAC changes reach the authorizer through its informer: wait until they did.
    eventually(
        lambda: _refused(lambda: core.list_namespaced_pod("kube-system")),
        "the agent's pods in kube-system refused",
    )
    _forbidden(lambda: core.list_pod_for_all_namespaces())
    _forbidden(lambda: core.read_namespaced_pod_status("kube-apiserver", "kube-system"))
    assert core.list_namespaced_pod(namespaced).items is not None

    cluster.run_notebook_pod(namespaced, "nb")
    extra = (
        "--rbac-scope=namespaces",
        f"--allowed-namespaces={namespaced}",
        "--allowed-namespace-selector=",
    )
    with running_node_agent(cluster, agent_account, extra=extra) as agent:
        api = agent.as_pod(namespaced, "nb")
        attached = api.post("/v1/attachments", {"count": 1})
        assert attached.status == 201, attached.body
        (attachment,) = attached.json()["attachments"]
        assert ENXIO in cluster.open_device(namespaced, "nb", attachment["minor"])
        assert len(cluster.holders(namespaced)) == 1
        assert api.delete("/v1/attachments").status == 204
        assert EPERM in cluster.open_fresh_node(namespaced, "nb", attachment["minor"])
        eventually(lambda: cluster.holders(namespaced) == [], "the holder deleted")
        assert "forbidden" not in agent.log().lower(), agent.log()[-3000:]


def _refused(call: Any) -> bool:
    try:
        call()
    except ApiException as e:
        return bool(e.status == 403)
    return False
