"""Issue 31, findings 1-5, on the real node: a hostile tenant forges what the agent trusts.

The tenant is a ServiceAccount allowed only ``pods`` create, patch and delete in its own
namespace (in z2jh that is the hub; in a shared cluster any Argo, Kubeflow or CI tenant). Her
forgeries, each as the issue saw it succeed:

1. a holder of her own making, with no GPU request, naming a free GPU and her container;
2. her own legitimate holder patched to name another tenant's GPU;
3. a holder in her namespace in state ``releasing`` naming the victim's container;
4. her notebook labelled as a holder (then her real holder deleted while the agent is down);
5. the holder label removed from her holder.

Each is tried twice. With the holder-protection policy of ``k8s/policy/`` installed, the API
server refuses it (403, naming the policy). With the policy absent (deleted for the test, put
back after), the agent restarted (a rollout, an OOM kill, a reboot) trusts nothing forged: the
forger cannot open the GPU (ENXIO: the device cgroup allows it, EPERM: it denies it), the
victim keeps hers, and the agent says so with an Event and
``gpu_hotplug_untrusted_holders_total``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import kubernetes.client as k8s
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from jupyter_gpu_hotplug._structs import PodTarget
from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec, holder_pod

from ..fixtures.device_messages import ENXIO, EPERM
from ..fixtures.requirements import needs_root
from ..k8s.image import PAUSE_IMAGE
from ..manifests.support import K8S_DIR, render
from .agent import (
    AGENT_NAMESPACE,
    AgentAccount,
    NodeAgent,
    agent_token,
    api_as,
    running_node_agent,
)
from .cluster import Cluster, eventually

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

POLICY: Final = "gpu-hotplug-holders-agent-only"
PREFIX: Final = "gpu-hotplug.jupyter.org"
HOLDER: Final = f"{PREFIX}/holder"
TENANT: Final = "tenant"
UNTRUSTED_EVENT: Final = "GpuHolderUntrusted"
METRIC: Final = re.compile(r'^gpu_hotplug_untrusted_holders_total\{reason="([a-z_]+)"\} (\S+)$')


# --- the cast ------------------------------------------------------------------------------------


@pytest.fixture
def tenant(cluster: Cluster, agent_account: AgentAccount) -> Iterator[tuple[str, Any]]:
    """Mallory: a namespace with her notebook ``nb``, and the API as her ServiceAccount that
    may only create, patch and delete pods there. Fresh for each test: a grant a test leaves
    in her container must not answer for the next one."""
    namespace = cluster.namespace("mallory", pod_security=None)
    cluster.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": TENANT, "namespace": namespace}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": TENANT, "namespace": namespace},
             "rules": [{"apiGroups": [""], "resources": ["pods"],
                        "verbs": ["create", "patch", "delete"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": TENANT, "namespace": namespace},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": TENANT},
             "subjects": [{"kind": "ServiceAccount", "name": TENANT, "namespace": namespace}]},
        ]
    )  # fmt: skip
    token = cluster.kubectl("create", "token", TENANT, "-n", namespace).strip()
    cluster.run_notebook_pod(namespace, "nb")
    with _emptied(cluster, namespace):
        yield namespace, k8s.CoreV1Api(api_as(token, cluster))


@pytest.fixture
def victim(cluster: Cluster, agent_account: AgentAccount) -> Iterator[str]:
    """Abel's namespace, with his notebook ``nb``: listed before hers (the API server lists
    pods by namespace), so that a start-up list in which the later claim of a GPU wins gives
    his GPU to her."""
    namespace = cluster.namespace("abel")
    cluster.run_notebook_pod(namespace, "nb")
    with _emptied(cluster, namespace):
        yield namespace


@contextmanager
def _emptied(cluster: Cluster, namespace: str) -> Iterator[None]:
    """Every pod of the namespace deleted after the test, and the GPUs its pods held free
    again (the node's four GPUs serve every test)."""
    try:
        yield
    finally:
        for pod in cluster.pods(namespace):
            cluster.delete_pod(namespace, pod["metadata"]["name"])
        eventually(lambda: not cluster.assignments(namespace), f"the GPUs of {namespace} free")


@pytest.fixture
def without_policy(cluster: Cluster, tenant: tuple[str, Any]) -> Iterator[None]:
    """The holder-protection policy deleted (as on a cluster that never installed it), put
    back after the test; each waits until the API server acts on the change."""
    namespace, api = tenant
    objects = [o for o in render() if o["metadata"]["name"] == POLICY]
    kinds = "validatingadmissionpolicybinding,validatingadmissionpolicy"
    cluster.kubectl("delete", kinds, POLICY, "--ignore-not-found")
    eventually(lambda: _admitted(api, namespace), "the API server admits forgeries again")
    try:
        yield
    finally:
        if objects:
            cluster.apply(objects)
            eventually(lambda: not _admitted(api, namespace), "the policy refuses forgeries")


def _admitted(api: Any, namespace: str) -> bool:
    """Whether the API server admits a pod labelled as a holder from the tenant (dry run)."""
    probe = _pause_pod("probe", labels={HOLDER: "true"})
    try:
        api.create_namespaced_pod(namespace, probe, dry_run="All")
    except ApiException as refused:
        assert refused.status == 403 and POLICY in str(refused.body), refused.body
        return False
    return True


# --- what she forges -----------------------------------------------------------------------------


def _pause_pod(
    name: str, *, labels: dict[str, str], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels, "annotations": annotations or {}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "hold", "image": PAUSE_IMAGE, "imagePullPolicy": "Never"}],
        },
    }


def _gpu(cluster: Cluster, uuid: str) -> dict[str, str]:
    """The holder annotations naming the GPU ``uuid`` (what the agent records)."""
    assert cluster.node.nvml_config is not None
    (gpu,) = [g for g in cluster.node.nvml_config.gpus if g.uuid == uuid]
    return {
        f"{PREFIX}/gpu-uuid": uuid,
        f"{PREFIX}/minor": str(gpu.minor),
        f"{PREFIX}/index": str(gpu.minor),
        f"{PREFIX}/gpu-name": gpu.name,
    }


def _free_gpu(cluster: Cluster) -> tuple[str, int]:
    """A whole GPU no pod of the node holds: its UUID and minor."""
    assert cluster.node.nvml_config is not None
    used = {d for ids in cluster.assignments().values() for d in ids}
    whole = cluster.node.nvml_config.gpus[: cluster.node.gpu_count]
    gpu = next(g for g in whole if g.uuid not in used)
    return gpu.uuid, gpu.minor


def _forged_holder(
    cluster: Cluster,
    *,
    name: str,
    owner: dict[str, Any],
    target: tuple[str, str],
    uuid: str,
    state: str = "granted",
) -> dict[str, Any]:
    """A pod dressed as a holder (no GPU request) in the owner's namespace: it serves the
    notebook container of ``target`` (namespace, pod) with the GPU ``uuid``."""
    namespace, pod = target
    target_pod = cluster.pod(namespace, pod)
    body = _pause_pod(
        name,
        labels={
            HOLDER: "true",
            f"{PREFIX}/target-uid": target_pod["metadata"]["uid"],
            f"{PREFIX}/container": "notebook",
        },
        annotations={
            f"{PREFIX}/state": state,
            f"{PREFIX}/target": PodTarget(namespace, pod, "notebook").key,
            f"{PREFIX}/container-id": f"containerd://{cluster.container_id(namespace, pod)}",
            f"{PREFIX}/node-created": "true",
            **_gpu(cluster, uuid),
        },
    )
    body["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Pod", "name": owner["metadata"]["name"],
         "uid": owner["metadata"]["uid"], "controller": False}
    ]  # fmt: skip
    body["spec"]["nodeName"] = cluster.node_name
    return body


def _denied(call: Callable[[], Any]) -> None:
    with pytest.raises(ApiException) as refused:
        call()
    assert refused.value.status == 403, refused.value.body
    assert POLICY in str(refused.value.body), refused.value.body


def _attach(agent: NodeAgent, namespace: str) -> dict[str, Any]:
    created = agent.as_pod(namespace, "nb").post("/v1/attachments", {"count": 1})
    assert created.status == 201, created.body
    (attachment,) = created.json()["attachments"]
    return dict(attachment)


def _holder_name(attachment: dict[str, Any]) -> str:
    return str(attachment["holder"]).split("/")[1]


@pytest.fixture(scope="module")
def scraper(cluster: Cluster, agent_account: AgentAccount) -> str:
    """A token that may read the agent's /metrics: the reader ``k8s/monitoring`` ships."""
    reader = yaml.safe_load_all((K8S_DIR / "monitoring" / "metrics-reader.yaml").read_text())
    objects = [o for o in reader if o and o["kind"] != "Secret"]
    for obj in objects:
        if obj["kind"] == "ServiceAccount":  # the monitoring kustomization's namespace
            obj["metadata"]["namespace"] = AGENT_NAMESPACE
    cluster.apply(objects)
    name = "gpu-hotplug-metrics-reader"
    return cluster.kubectl("create", "token", name, "-n", AGENT_NAMESPACE).strip()


def _untrusted(agent: NodeAgent, scraper: str) -> dict[str, float]:
    """``gpu_hotplug_untrusted_holders_total`` by reason, from the agent's /metrics."""
    assert agent.process.tcp is not None
    answer = agent.process.tcp.with_token(scraper).get("/metrics")
    assert answer.status == 200, answer.body
    found = {}
    for line in answer.body.decode().splitlines():
        if (match := METRIC.match(line)) is not None:
            found[match[1]] = float(match[2])
    return found


def _reported(
    cluster: Cluster, agent: NodeAgent, scraper: str, namespace: str, holder: str
) -> None:
    """The agent distrusted the holder, and said so: an Event on it, the counter, its log."""
    eventually(
        lambda: UNTRUSTED_EVENT in cluster.event_reasons(namespace, holder),
        f"a {UNTRUSTED_EVENT} Event on {namespace}/{holder}",
    )
    assert sum(_untrusted(agent, scraper).values()) >= 1, _untrusted(agent, scraper)
    assert f"{namespace}/{holder}" in agent.log()


# --- with the policy: refused at admission -------------------------------------------------------


@pytest.fixture
def own_holder(cluster: Cluster, tenant: tuple[str, Any]) -> dict[str, Any]:
    """A holder of her notebook as the agent makes it (created with the agent's token)."""
    namespace, _ = tenant
    as_agent: Any = k8s.CoreV1Api(api_as(agent_token(cluster, cluster.node_name), cluster))
    notebook = cluster.pod(namespace, "nb")
    holder = holder_pod(
        notebook,
        container="notebook",
        container_id=cluster.container_id(namespace, "nb"),
        request_id=None,
        index=0,
        spec=HolderSpec(node_name=cluster.node_name, image=PAUSE_IMAGE),
    )
    created = as_agent.create_namespaced_pod(namespace, holder)
    return dict(cluster.api.sanitize_for_serialization(created))


def test_a_forged_holder_is_refused(cluster: Cluster, tenant: tuple[str, Any], victim: str) -> None:
    namespace, api = tenant
    notebook = cluster.pod(namespace, "nb")
    uuid, _ = _free_gpu(cluster)
    forged = _forged_holder(
        cluster, name="forged", owner=notebook, target=(namespace, "nb"), uuid=uuid
    )
    _denied(lambda: api.create_namespaced_pod(namespace, forged))
    # Without the label, the holder annotations alone are refused too.
    del forged["metadata"]["labels"][HOLDER]
    _denied(lambda: api.create_namespaced_pod(namespace, forged))
    releasing = _forged_holder(
        cluster,
        name="releasing",
        owner=notebook,
        target=(victim, "nb"),
        uuid=uuid,
        state="releasing",
    )
    _denied(lambda: api.create_namespaced_pod(namespace, releasing))


def test_her_own_holder_cannot_be_patched_or_relabelled(
    cluster: Cluster, tenant: tuple[str, Any], own_holder: dict[str, Any]
) -> None:
    namespace, api = tenant
    name = own_holder["metadata"]["name"]
    uuid, _ = _free_gpu(cluster)
    gpu = {"metadata": {"annotations": _gpu(cluster, uuid)}}
    _denied(lambda: api.patch_namespaced_pod(name, namespace, gpu))
    state = {"metadata": {"annotations": {f"{PREFIX}/state": "releasing"}}}
    _denied(lambda: api.patch_namespaced_pod(name, namespace, state))
    unlabel = {"metadata": {"labels": {HOLDER: None}}}
    _denied(lambda: api.patch_namespaced_pod(name, namespace, unlabel))
    assert cluster.pod(namespace, name)["metadata"]["labels"][HOLDER] == "true"


def test_her_notebook_cannot_be_labelled_a_holder(
    cluster: Cluster, tenant: tuple[str, Any]
) -> None:
    namespace, api = tenant
    label = {"metadata": {"labels": {HOLDER: "true"}}}
    _denied(lambda: api.patch_namespaced_pod("nb", namespace, label))
    assert HOLDER not in (cluster.pod(namespace, "nb")["metadata"].get("labels") or {})


def test_notebook_annotations_and_deleting_her_holder_stay_allowed(
    cluster: Cluster, tenant: tuple[str, Any], own_holder: dict[str, Any]
) -> None:
    """What the spawner and the hub write on notebook pods is not holder state; a user who
    deletes her holder gives her GPU back (the agent revokes it: a handled case)."""
    namespace, api = tenant
    notebook = _pause_pod(
        "spawned",
        labels={},
        annotations={
            f"{PREFIX}/max-gpus": "1",
            f"{PREFIX}/idle-release-seconds": "3600",
            f"{PREFIX}/container": "hold",
        },
    )
    api.create_namespaced_pod(namespace, notebook)
    api.patch_namespaced_pod(
        "spawned", namespace, {"metadata": {"annotations": {f"{PREFIX}/max-gpus": "2"}}}
    )
    api.delete_namespaced_pod("spawned", namespace, grace_period_seconds=0)
    api.delete_namespaced_pod(own_holder["metadata"]["name"], namespace, grace_period_seconds=0)
    eventually(
        lambda: cluster.gone(namespace, own_holder["metadata"]["name"]), "her holder deleted"
    )


# --- without the policy: the agent restarted trusts nothing forged ------------------------------


@pytest.mark.usefixtures("without_policy")
def test_a_forged_holder_of_a_free_gpu_is_not_trusted(
    cluster: Cluster, agent_account: AgentAccount, tenant: tuple[str, Any], scraper: str
) -> None:
    """Finding 1: her forged holder (no GPU request) names a free GPU and her container."""
    namespace, api = tenant
    with running_node_agent(cluster, agent_account) as agent:
        agent.process.stop()
        uuid, minor = _free_gpu(cluster)
        notebook = cluster.pod(namespace, "nb")
        api.create_namespaced_pod(
            namespace,
            _forged_holder(
                cluster, name="forged", owner=notebook, target=(namespace, "nb"), uuid=uuid
            ),
        )
        cluster.wait_running(namespace, "forged")
        agent.process.start()

        assert EPERM in cluster.open_fresh_node(namespace, "nb", minor)
        _reported(cluster, agent, scraper, namespace, "forged")
        assert agent.as_pod(namespace, "nb").get("/v1/attachments").json()["attachments"] == []


@pytest.mark.usefixtures("without_policy")
def test_her_holder_patched_to_the_victims_gpu_steals_nothing(
    cluster: Cluster,
    agent_account: AgentAccount,
    tenant: tuple[str, Any],
    victim: str,
    scraper: str,
) -> None:
    """Finding 2: her legitimate holder's GPU annotations patched to the victim's GPU."""
    namespace, api = tenant
    with running_node_agent(cluster, agent_account) as agent:
        theirs = _attach(agent, victim)
        mine = _attach(agent, namespace)
        agent.process.stop()
        patch = {"metadata": {"annotations": _gpu(cluster, theirs["uuid"])}}
        api.patch_namespaced_pod(_holder_name(mine), namespace, patch)
        agent.process.start()

        assert EPERM in cluster.open_fresh_node(namespace, "nb", theirs["minor"])
        assert ENXIO in cluster.open_device(victim, "nb", theirs["minor"])
        (kept,) = agent.as_pod(victim, "nb").get("/v1/attachments").json()["attachments"]
        assert kept["uuid"] == theirs["uuid"]
        _reported(cluster, agent, scraper, namespace, _holder_name(mine))
        assert agent.as_pod(victim, "nb").delete("/v1/attachments").status == 204


@pytest.mark.usefixtures("without_policy")
def test_a_forged_release_revokes_nothing_of_the_victims(
    cluster: Cluster,
    agent_account: AgentAccount,
    tenant: tuple[str, Any],
    victim: str,
    scraper: str,
) -> None:
    """Finding 3: a holder in her namespace in state ``releasing`` naming the victim's
    container and GPU."""
    namespace, api = tenant
    with running_node_agent(cluster, agent_account) as agent:
        theirs = _attach(agent, victim)
        agent.process.stop()
        forged = _forged_holder(
            cluster,
            name="releasing",
            owner=cluster.pod(namespace, "nb"),
            target=(victim, "nb"),
            uuid=theirs["uuid"],
            state="releasing",
        )
        api.create_namespaced_pod(namespace, forged)
        cluster.wait_running(namespace, "releasing")
        agent.process.start()

        assert ENXIO in cluster.open_device(victim, "nb", theirs["minor"])
        (kept,) = agent.as_pod(victim, "nb").get("/v1/attachments").json()["attachments"]
        assert kept["uuid"] == theirs["uuid"]
        assert {d for ids in cluster.assignments(victim).values() for d in ids} == {theirs["uuid"]}
        _reported(cluster, agent, scraper, namespace, "releasing")
        assert not cluster.gone(namespace, "releasing"), "the forgery is kept as evidence"
        assert agent.as_pod(victim, "nb").delete("/v1/attachments").status == 204


@pytest.mark.usefixtures("without_policy")
def test_a_notebook_labelled_as_a_holder_loses_its_orphaned_grant(
    cluster: Cluster, agent_account: AgentAccount, tenant: tuple[str, Any]
) -> None:
    """Finding 4: her notebook labelled as a holder, her real holder deleted while the agent
    is down: the sweep still finds her orphaned grant and revokes it."""
    namespace, api = tenant
    with running_node_agent(cluster, agent_account, extra=("--lost-grace=1",)) as agent:
        mine = _attach(agent, namespace)
        agent.process.stop()
        api.patch_namespaced_pod("nb", namespace, {"metadata": {"labels": {HOLDER: "true"}}})
        api.delete_namespaced_pod(_holder_name(mine), namespace, grace_period_seconds=0)
        eventually(lambda: cluster.gone(namespace, _holder_name(mine)), "her holder deleted")
        agent.process.start()

        eventually(
            lambda: EPERM in cluster.open_fresh_node(namespace, "nb", mine["minor"]),
            "her orphaned grant is revoked",
        )
        assert agent.as_pod(namespace, "nb").get("/v1/attachments").json()["attachments"] == []


@pytest.mark.usefixtures("without_policy")
@pytest.mark.parametrize("restarted", [False, True], ids=["running", "restarted"])
def test_a_relabelled_holder_is_still_released(
    cluster: Cluster, agent_account: AgentAccount, tenant: tuple[str, Any], restarted: bool
) -> None:
    """Finding 5: the holder label removed from her holder (while the agent runs, or while it
    is down): her detach is no 500, and the kubelet frees the GPU."""
    namespace, api = tenant
    with running_node_agent(cluster, agent_account) as agent:
        mine = _attach(agent, namespace)
        if restarted:
            agent.process.stop()
        unlabel = {"metadata": {"labels": {HOLDER: None}}}
        api.patch_namespaced_pod(_holder_name(mine), namespace, unlabel)
        if restarted:
            agent.process.start()

        detached = agent.as_pod(namespace, "nb").delete(f"/v1/attachments/{mine['uuid']}")

        assert detached.status == 204, detached.body
        eventually(lambda: cluster.gone(namespace, _holder_name(mine)), "the holder is deleted")
        eventually(lambda: not cluster.assignments(namespace), "the kubelet frees the GPU")
        assert EPERM in cluster.open_fresh_node(namespace, "nb", mine["minor"])
