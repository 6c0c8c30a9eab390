"""The admission policy of ``k8s/policy/`` on the real API server: the agent's ServiceAccount may
create, patch and delete holder pods of its own node, and nothing else.

The agent's identity is what its DaemonSet pod holds: a token of its ServiceAccount bound to a
pod on the node (``agent.agent_token``), so the API server puts the node's name into the
request's user info. The holders admitted are the ones the agent itself builds
(``holders.holder_pod``); each forged one differs from such a holder in one way and is refused,
with the policy's name in the answer. A second Node object without a kubelet gives the token
of an agent elsewhere.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any, Final

import kubernetes.client as k8s
import pytest
from kubernetes.client.exceptions import ApiException

from ..fixtures.requirements import needs_root
from ..k8s.image import TOOLS_IMAGE
from .agent import (
    AGENT_ACCOUNT,
    AGENT_NAMESPACE,
    AgentAccount,
    agent_token,
    api_as,
    holder_as_the_agent_builds_it,
    node_elsewhere,
)
from .cluster import Cluster, eventually

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

POLICY: Final = "gpu-hotplug-agent-holders-only"
HOLDER_PROTECTION: Final = "gpu-hotplug-holders-agent-only"
"""The policy that lets only the agent write holder state (``test_forgery.py``)."""
NODE_NAME_EXTRA: Final = "authentication.kubernetes.io/node-name"
ELSEWHERE: Final = "gpu-hotplug-elsewhere"
"""A Node object with no kubelet: the node of another agent."""

Forgery = Callable[[dict[str, Any]], None]


def _client(token: str, cluster: Cluster) -> Any:
    """CoreV1Api that authenticates with ``token`` (and nothing else)."""
    return k8s.CoreV1Api(api_as(token, cluster))


@pytest.fixture(scope="module")
def elsewhere(cluster: Cluster) -> Iterator[str]:
    with node_elsewhere(cluster, ELSEWHERE) as name:
        yield name


@pytest.fixture(scope="module")
def as_agent(cluster: Cluster, agent_account: AgentAccount) -> Any:
    """The API as this node's agent (a token bound to a pod on this node)."""
    return _client(agent_token(cluster, cluster.node_name), cluster)


@pytest.fixture(scope="module")
def as_agent_elsewhere(cluster: Cluster, agent_account: AgentAccount, elsewhere: str) -> Any:
    return _client(agent_token(cluster, elsewhere), cluster)


@pytest.fixture(scope="module")
def notebook(cluster: Cluster, agent_account: AgentAccount) -> dict[str, Any]:
    """A running notebook pod, in a namespace without PodSecurity enforcement: whatever is
    refused there, the admission policy refused."""
    namespace = cluster.namespace("vap", pod_security=None)
    cluster.run_notebook_pod(namespace, "nb")
    return cluster.pod(namespace, "nb")


def _denied(call: Callable[[], Any]) -> str:
    with pytest.raises(ApiException) as refused:
        call()
    assert refused.value.status == 403, refused.value.body
    body = str(refused.value.body)
    assert POLICY in body, body
    return body


@pytest.mark.parametrize("policy_name", [POLICY, HOLDER_PROTECTION])
def test_the_policy_type_checks(
    cluster: Cluster, agent_account: AgentAccount, policy_name: str
) -> None:
    """The API server compiled every expression of both policies and found no type error."""
    api: Any = k8s.AdmissionregistrationV1Api(cluster.api)

    def checked() -> Any:
        policy = cluster.api.sanitize_for_serialization(
            api.read_validating_admission_policy(policy_name)
        )
        status = policy.get("status") or {}
        generation = policy["metadata"]["generation"]
        return status if status.get("observedGeneration") == generation else None

    status = eventually(checked, "the API server type-checked the policy")
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status
    assert not [c for c in status.get("conditions") or [] if c.get("status") == "False"], status


def test_the_agents_token_names_its_node(cluster: Cluster, agent_account: AgentAccount) -> None:
    token = agent_token(cluster, cluster.node_name)
    # Typed as Any: a plain dict is the body, as the client serializes it.
    authentication: Any = k8s.AuthenticationV1Api(cluster.api)
    review: dict[str, Any] = cluster.api.sanitize_for_serialization(
        authentication.create_token_review({"spec": {"token": token}})
    )
    status = review["status"]
    assert status["authenticated"], status
    assert status["user"]["username"] == f"system:serviceaccount:{AGENT_NAMESPACE}:{AGENT_ACCOUNT}"
    assert status["user"]["extra"][NODE_NAME_EXTRA] == [cluster.node_name]


def test_the_agents_own_holder_is_admitted(
    cluster: Cluster, notebook: dict[str, Any], as_agent: Any
) -> None:
    holder = holder_as_the_agent_builds_it(cluster, notebook, 0)
    namespace, name = holder["metadata"]["namespace"], holder["metadata"]["name"]
    as_agent.create_namespaced_pod(namespace, holder)
    # Recording its state: an UPDATE of a holder of this node.
    as_agent.patch_namespaced_pod(
        name, namespace, {"metadata": {"annotations": {"gpu-hotplug.jupyter.org/state": "granted"}}}
    )
    assert cluster.pod(namespace, name)["spec"]["nodeName"] == cluster.node_name
    as_agent.delete_namespaced_pod(name, namespace, grace_period_seconds=1)
    eventually(lambda: cluster.gone(namespace, name), f"holder {name} deleted by the agent")


def _volume(pod: dict[str, Any]) -> None:
    pod["spec"]["volumes"] = [{"name": "host", "hostPath": {"path": "/"}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "host", "mountPath": "/host"}]


def _other_node(pod: dict[str, Any]) -> None:
    pod["spec"]["nodeName"] = ELSEWHERE


def _other_image(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["image"] = TOOLS_IMAGE


def _privileged(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}


def _host_pid(pod: dict[str, Any]) -> None:
    pod["spec"]["hostPID"] = True


def _every_gpu(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]


def _token(pod: dict[str, Any]) -> None:
    pod["spec"]["automountServiceAccountToken"] = True


def _command(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", "cat /etc/shadow"]


def _not_a_holder(pod: dict[str, Any]) -> None:
    del pod["metadata"]["labels"]["gpu-hotplug.jupyter.org/holder"]


def _kube_system(pod: dict[str, Any]) -> None:
    pod["metadata"]["namespace"] = "kube-system"


def _system_priority(pod: dict[str, Any]) -> None:
    pod["spec"]["priorityClassName"] = "system-node-critical"


def _resources(**amounts: str) -> Forgery:
    def forge(pod: dict[str, Any]) -> None:
        resources = pod["spec"]["containers"][0]["resources"]
        for kind in ("requests", "limits"):
            resources[kind].update(amounts)

    return forge


def _root_without_seccomp(pod: dict[str, Any]) -> None:
    pod["spec"]["securityContext"] = {"runAsUser": 0}


def _tolerates_everything(pod: dict[str, Any]) -> None:
    pod["spec"]["tolerations"] = [{"operator": "Exists"}]


def _host_aliases(pod: dict[str, Any]) -> None:
    pod["spec"]["hostAliases"] = [{"ip": "10.0.0.1", "hostnames": ["kubernetes.default.svc"]}]


FORGERIES: Final[dict[str, Forgery]] = {
    "hostPath volume": _volume,
    "another node": _other_node,
    "another image": _other_image,
    "privileged": _privileged,
    "host pid namespace": _host_pid,
    "NVIDIA_VISIBLE_DEVICES=all": _every_gpu,
    "service-account token": _token,
    "own command": _command,
    "no holder label": _not_a_holder,
    # Issue 31, finding 9: each of these was admitted by the policy before.
    "in kube-system": _kube_system,
    "system-node-critical priority": _system_priority,
    "64 CPUs": _resources(cpu="64"),
    "512Gi of memory": _resources(memory="512Gi"),
    "4 GPUs": _resources(**{"nvidia.com/gpu": "4"}),
    "runAsUser 0 without seccomp": _root_without_seccomp,
    "tolerates every taint": _tolerates_everything,
    "hostAliases": _host_aliases,
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_holder_is_denied(
    cluster: Cluster, notebook: dict[str, Any], as_agent: Any, elsewhere: str, forgery: str
) -> None:
    pod = copy.deepcopy(holder_as_the_agent_builds_it(cluster, notebook, 1))
    FORGERIES[forgery](pod)
    namespace = pod["metadata"]["namespace"]
    _denied(lambda: as_agent.create_namespaced_pod(namespace, pod))
    assert cluster.holders(namespace) == []


def test_the_agent_cannot_touch_other_pods(
    cluster: Cluster, notebook: dict[str, Any], as_agent: Any
) -> None:
    namespace, name = notebook["metadata"]["namespace"], notebook["metadata"]["name"]
    _denied(lambda: as_agent.delete_namespaced_pod(name, namespace))
    # Nor make one a holder first, to delete it then.
    label = {"metadata": {"labels": {"gpu-hotplug.jupyter.org/holder": "true"}}}
    _denied(lambda: as_agent.patch_namespaced_pod(name, namespace, label))
    assert cluster.pod(namespace, name)["metadata"]["uid"] == notebook["metadata"]["uid"]
    assert cluster.wait_running(namespace, name)


def test_an_agent_elsewhere_cannot_touch_this_nodes_holders(
    cluster: Cluster, notebook: dict[str, Any], as_agent: Any, as_agent_elsewhere: Any
) -> None:
    holder = holder_as_the_agent_builds_it(cluster, notebook, 2)
    namespace, name = holder["metadata"]["namespace"], holder["metadata"]["name"]
    _denied(lambda: as_agent_elsewhere.create_namespaced_pod(namespace, holder))
    as_agent.create_namespaced_pod(namespace, holder)
    try:
        _denied(lambda: as_agent_elsewhere.delete_namespaced_pod(name, namespace))
        patch = {"metadata": {"annotations": {"gpu-hotplug.jupyter.org/state": "granted"}}}
        _denied(lambda: as_agent_elsewhere.patch_namespaced_pod(name, namespace, patch))
    finally:
        as_agent.delete_namespaced_pod(name, namespace, grace_period_seconds=1)
    eventually(lambda: cluster.gone(namespace, name), f"holder {name} deleted by its own agent")


UPDATES: Final[dict[str, dict[str, Any]]] = {
    "drop the ownerReferences": {"metadata": {"ownerReferences": None}},
    "add a finalizer": {"metadata": {"finalizers": ["example.com/keep"]}},
    "rewrite the target": {
        "metadata": {"annotations": {"gpu-hotplug.jupyter.org/target": "other/victim/notebook"}}
    },
    "rewrite the target uid": {
        "metadata": {"labels": {"gpu-hotplug.jupyter.org/target-uid": "0000-forged"}}
    },
}


@pytest.mark.parametrize("update", UPDATES)
def test_what_ties_a_holder_to_its_notebook_never_changes(
    cluster: Cluster, notebook: dict[str, Any], as_agent: Any, update: str
) -> None:
    """Issue 31, finding 9: the agent's own UPDATEs that would cut a holder loose from its
    notebook (garbage collection, the target it grants to) were admitted before."""
    holder = holder_as_the_agent_builds_it(cluster, notebook, 3)
    namespace, name = holder["metadata"]["namespace"], holder["metadata"]["name"]
    as_agent.create_namespaced_pod(namespace, holder)
    try:
        _denied(lambda: as_agent.patch_namespaced_pod(name, namespace, UPDATES[update]))
        after = cluster.pod(namespace, name)["metadata"]
        assert after["ownerReferences"] == holder["metadata"]["ownerReferences"]
        assert not after.get("finalizers")
        assert (
            after["annotations"]["gpu-hotplug.jupyter.org/target"]
            == (holder["metadata"]["annotations"]["gpu-hotplug.jupyter.org/target"])
        )
        assert after["labels"] == holder["metadata"]["labels"]
    finally:
        as_agent.delete_namespaced_pod(name, namespace, grace_period_seconds=1)
    eventually(lambda: cluster.gone(namespace, name), f"holder {name} deleted by the agent")
