"""The agent needs no more than the RBAC that ``k8s/`` ships: the fake apiserver holds it to the
rendered ClusterRole (every other request is refused 403, as the real RBAC authorizer does) while
a notebook pod attaches and detaches, an operator acts on it through ``pods/gpus``, and the
notebook pod is deleted. A rule missing from ``k8s/base/rbac.yaml`` fails one of these steps;
a rule the agent never uses is caught by ``tests/manifests``' exact least-privilege table.

Why this stays beside the real node, where the agent also runs as exactly this RBAC
(``tests/realnode/agent.py``): that API server runs the default admission chain, without
``OwnerReferencesPermissionEnforcement``, so only here does a missing ``pods/finalizers``
``update`` (holders set ``blockOwnerDeletion``) fail, as it does on clusters that enable it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.fixtures.requirements import needs_root
from tests.manifests.support import by_kind, render

from ..agent.agent_process import AgentProcess
from .agent import as_pod, holders
from .kube import AGENT_USER, FakeKube
from .kubelet import KubeletSimulator

pytestmark = [*needs_root, pytest.mark.k8s, pytest.mark.slow]

NS = "team-rbac"
AGENT_ROLE = "gpu-hotplug-agent"
OPERATOR_ROLE = "gpu-hotplug-operator"
CLEANUP_TIMEOUT = 60.0
"""Upper bound for the agent to notice a deleted notebook pod; never asserted as a time."""


@pytest.fixture
def shipped_rbac(kube: FakeKube) -> Iterator[None]:
    """From here on the apiserver allows the agent exactly its ClusterRole from ``k8s/``, and
    operators in group ``gpu-operators`` the shipped operator role."""
    objects = render()
    kube.grant(by_kind(objects, "ClusterRole", AGENT_ROLE), users=(AGENT_USER,))
    kube.grant(by_kind(objects, "ClusterRole", OPERATOR_ROLE), groups=("gpu-operators",))
    kube.authorize_callers()
    yield
    kube.authorize_callers(False)


def test_the_agent_works_with_the_rbac_it_ships(
    kube: FakeKube,
    shipped_rbac: None,
    kubelet: KubeletSimulator,
    k8s_agent: AgentProcess,
) -> None:
    kubelet.run_notebook_pod(NS, "nb")
    api = as_pod(k8s_agent, kube, NS, "nb")

    created = api.post("/v1/attachments", {"count": 1})
    assert created.status == 201, created.body
    (attachment,) = created.json()["attachments"]
    assert [f"{NS}/{h['metadata']['name']}" for h in holders(kube, NS)] == [attachment["holder"]]

    # An operator reaches another pod's GPUs through pods/gpus (a SubjectAccessReview).
    kube.add_token(
        "operator-token", username="olga", groups=("gpu-operators",), audiences=("gpu-hotplug",)
    )
    assert k8s_agent.tcp is not None
    operator = k8s_agent.tcp.with_token("operator-token")
    listed = operator.get(f"/v1/attachments?pod={NS}/nb")
    assert [a["uuid"] for a in listed.json()["attachments"]] == [attachment["uuid"]], listed.body
    assert api.delete(f"/v1/attachments/{attachment['uuid']}").status == 204
    assert holders(kube, NS) == []

    # Attach again, then delete the notebook pod: its holder is collected, and the agent's
    # pod watch (list/watch across namespaces) lets it free the GPU.
    assert api.post("/v1/attachments", {"count": 1}).status == 201
    kube.delete_pod(NS, "nb")
    deadline = time.monotonic() + CLEANUP_TIMEOUT
    while time.monotonic() < deadline:
        gpus = k8s_agent.tcp.with_token("operator-token").get("/v1/gpus").json()["gpus"]
        if holders(kube, NS) == [] and all(g["state"] == "free" for g in gpus):
            break
        time.sleep(0.2)
    assert holders(kube, NS) == []
    assert all(g["state"] == "free" for g in gpus), gpus
    assert "forbidden" not in k8s_agent.log().lower(), k8s_agent.log()[-4000:]
