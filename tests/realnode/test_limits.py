"""Fail-closed limits and reads that need a token, on the real node (issue 31, findings 6 and 8).

What a tenant found: a pod in an unlabelled namespace with no ``max-gpus`` annotation took every
GPU of the node; ``/metrics`` and the OpenAPI document answered anyone; ``/v1/gpus`` named other
tenants' pods. Here the real API server decides every part of the answer the agent relies on:
the Namespace's labels (read with the agent's own RBAC), TokenReview of a ServiceAccount's
ordinary token, and SubjectAccessReview of the non-resource URL and of ``pods/gpus`` against
real ClusterRoles.
"""

from __future__ import annotations

from typing import Any

import pytest

from ..agent.api_harness import ApiClient
from ..fixtures.requirements import needs_root
from .agent import AgentAccount, NodeAgent, running_node_agent
from .cluster import NOTEBOOKS_LABEL, Cluster, eventually

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

MAX_GPUS = "gpu-hotplug.jupyter.org/max-gpus"


def _service_account_token(
    cluster: Cluster,
    namespace: str,
    name: str,
    *,
    rule: dict[str, list[str]] | None = None,
    audience: str | None = None,
) -> str:
    """A token of a new ServiceAccount — an ordinary one (the API server's audience, as a
    Prometheus pod mounts it) unless ``audience`` is given — bound by a ClusterRoleBinding to a
    ClusterRole of the one ``rule`` when one is given."""
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": namespace},
        }
    ]
    if rule is not None:
        role = f"{namespace}-{name}"
        objects += [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": role},
                "rules": [rule],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": role},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": role,
                },
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
            },
        ]
    cluster.apply(objects)
    args = ("create", "token", name, "-n", namespace)
    return cluster.kubectl(*args, *([f"--audience={audience}"] if audience else [])).strip()


def test_a_pod_in_a_namespace_outside_the_allowlist_is_refused_naming_the_namespace(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    ns = cluster.namespace("closed", gpus=False)
    cluster.run_notebook_pod(ns, "nb")
    api = node_agent.as_pod(ns, "nb")

    refused = api.post("/v1/attachments", {"count": 1})

    assert (refused.status, refused.error) == (403, "forbidden"), refused.body
    message = refused.json()["message"]
    assert ns in message and "allowed-namespace" in message, message
    assert cluster.holders(ns) == []

    # The label the operator guide names is what lets a namespace in (read at each attach).
    cluster.kubectl("label", "namespace", ns, f"{NOTEBOOKS_LABEL}=true")
    assert api.post("/v1/attachments", {"count": 1}).status == 201
    assert api.delete("/v1/attachments").status == 204
    eventually(lambda: cluster.holders(ns) == [], "no holder left")


def test_a_pod_without_the_annotation_gets_the_default_limit_and_one_with_it_its_own(
    cluster: Cluster, agent_account: AgentAccount
) -> None:
    ns = cluster.namespace()
    cluster.run_notebook_pod(ns, "plain")
    cluster.run_notebook_pod(ns, "annotated", annotations={MAX_GPUS: "2"})
    with running_node_agent(cluster, agent_account, extra=("--default-max-gpus=1",)) as agent:
        plain = agent.as_pod(ns, "plain")

        over = plain.post("/v1/attachments", {"count": 2})
        assert (over.status, over.error, over.json()["limit"]) == (403, "forbidden", 1), over.body
        assert "default-max-gpus" in over.json()["message"]
        assert plain.post("/v1/attachments", {"count": 1}).status == 201
        again = plain.post("/v1/attachments", {"count": 1})
        assert (again.status, again.json()["attached"]) == (403, 1), again.body

        annotated = agent.as_pod(ns, "annotated")
        assert annotated.post("/v1/attachments", {"count": 2}).status == 201
        eventually(lambda: len(cluster.holders(ns)) == 3, "three holders: one and two")
        for api in (plain, annotated):
            assert api.delete("/v1/attachments").status == 204
        eventually(lambda: cluster.holders(ns) == [], "no holder left")


@pytest.mark.parametrize("path", ["/metrics", "/v1/openapi.json"])
def test_the_agents_own_reads_need_a_reviewed_token_and_rbac_on_the_url(
    cluster: Cluster, node_agent: NodeAgent, path: str
) -> None:
    tcp = node_agent.process.tcp
    assert tcp is not None
    ns = cluster.namespace("scrape")
    denied = _service_account_token(cluster, ns, "nobody")
    allowed = _service_account_token(
        cluster, ns, "prometheus", rule={"nonResourceURLs": [path], "verbs": ["get"]}
    )

    anonymous = tcp.with_token(None).get(path)
    assert (anonymous.status, anonymous.error) == (401, "unauthenticated"), anonymous.body
    unknown = tcp.with_token("not-a-token").get(path)
    assert unknown.status == 401
    refused = tcp.with_token(denied).get(path)
    assert (refused.status, refused.error) == (403, "forbidden"), refused.body
    assert path in refused.json()["message"]
    served = tcp.with_token(allowed).get(path)
    assert served.status == 200, served.body
    assert (b"gpu_hotplug_" if path == "/metrics" else b'"openapi"') in served.body
    # The kubelet's probes carry no token: liveness and readiness stay open.
    for probe in ("/healthz", "/readyz"):
        assert tcp.with_token(None).get(probe).status == 200


def test_another_tenant_sees_a_gpu_attached_but_not_whose_and_an_operator_sees_whose(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    mine, theirs = cluster.namespace("mine"), cluster.namespace("theirs")
    cluster.run_notebook_pod(mine, "nb")
    cluster.run_notebook_pod(theirs, "nb")
    me, them = node_agent.as_pod(mine, "nb"), node_agent.as_pod(theirs, "nb")
    (attachment,) = me.post("/v1/attachments", {"count": 1}).json()["attachments"]
    owner = {"pod": {"namespace": mine, "name": "nb", "container": "notebook"}}

    def listed(api: ApiClient) -> dict[str, Any]:
        gpus = api.get("/v1/gpus").json()["gpus"]
        return next(gpu for gpu in gpus if gpu["uuid"] == attachment["uuid"])

    assert (listed(me)["state"], listed(me)["target"]) == ("attached", owner)
    assert (listed(them)["state"], listed(them)["target"]) == ("attached", None)
    assert mine not in them.get("/v1/gpus").body.decode()

    tcp = node_agent.process.tcp
    assert tcp is not None
    operator = tcp.with_token(
        _service_account_token(
            cluster,
            theirs,
            "operator",
            rule={"apiGroups": [""], "resources": ["pods/gpus"], "verbs": ["get"]},
            audience="gpu-hotplug",
        )
    )
    assert listed(operator)["target"] == owner
    assert me.delete("/v1/attachments").status == 204
    eventually(lambda: cluster.holders(mine) == [], "no holder left")
