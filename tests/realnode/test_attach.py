"""Kubernetes mode on the real node: the agent (a subprocess, as its ServiceAccount with the RBAC
of ``k8s/``) attaches GPUs to a notebook container through holder pods that the real kubelet's
device manager admits with NVIDIA's device plugin; access is proven from inside the container
(ENXIO: the cgroup allows the GPU's node; EPERM: it denies it). Identities are real pod-bound
tokens checked with the real TokenReview, SubjectAccessReview and RBAC; quota is the real
ResourceQuota admission; garbage collection is the real controller manager's."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from jupyter_gpu_hotplug.agent.core.checkpoints import marker_path

from ..agent.api_harness import ApiClient
from ..fixtures.device_messages import ENXIO, EPERM
from ..fixtures.requirements import needs_root
from .agent import AgentAccount, NodeAgent, running_node_agent
from .cluster import WAIT, Cluster, eventually

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]

MAX_GPUS = "gpu-hotplug.jupyter.org/max-gpus"


def devices_of(cluster: Cluster, namespace: str) -> set[str]:
    return {d for ids in cluster.assignments(namespace).values() for d in ids}


def notebooks(
    cluster: Cluster, node_agent: NodeAgent, *names: str
) -> tuple[str, tuple[ApiClient, ...]]:
    """A fresh namespace with a notebook pod of each name in it: the namespace, and the
    agent's API as each pod calls it."""
    ns = cluster.namespace()
    for name in names:
        cluster.run_notebook_pod(ns, name)
    return ns, tuple(node_agent.as_pod(ns, name) for name in names)


def test_a_pod_attaches_two_gpus_through_real_holders_and_detaches_one(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    ns = cluster.namespace()
    notebook = cluster.run_notebook_pod(ns, "nb")
    api = node_agent.as_pod(ns, "nb")

    created = api.post("/v1/attachments", {"count": 2})

    assert created.status == 201, created.body
    attachments = created.json()["attachments"]
    held = cluster.holders(ns)
    assert {f"{ns}/{h['metadata']['name']}" for h in held} == {a["holder"] for a in attachments}
    for holder in held:
        assert holder["status"]["phase"] == "Running"
        assert holder["status"]["qosClass"] == "Guaranteed"
        assert holder["spec"]["nodeName"] == cluster.node_name
        (owner,) = holder["metadata"]["ownerReferences"]
        assert (owner["name"], owner["uid"]) == ("nb", notebook["metadata"]["uid"])
    # The real kubelet's PodResources names exactly the GPUs the agent injected.
    holder_names = {h["metadata"]["name"] for h in held}
    reported = {
        d
        for (namespace, pod), ids in cluster.assignments(ns).items()
        if pod in holder_names
        for d in ids
    }
    assert reported == {a["uuid"] for a in attachments}
    for holder in held:  # and PodResources Get, per holder, says the same
        (device,) = cluster.podresources_get(ns, holder["metadata"]["name"])
        assert device in reported
    for attachment in attachments:
        assert ENXIO in cluster.open_device(ns, "nb", attachment["minor"])

    first, second = attachments
    assert api.delete(f"/v1/attachments/{first['uuid']}").status == 204
    assert [a["uuid"] for a in api.get("/v1/attachments").json()["attachments"]] == [second["uuid"]]
    assert "No such file" in cluster.open_device(ns, "nb", first["minor"])
    assert EPERM in cluster.open_fresh_node(ns, "nb", first["minor"])
    assert ENXIO in cluster.open_device(ns, "nb", second["minor"])
    eventually(lambda: devices_of(cluster, ns) == {second["uuid"]}, "the kubelet frees one GPU")
    eventually(
        lambda: cluster.event_reasons(ns, "nb").count("GpuDetached") == 1,
        "a GpuDetached Event on the notebook pod",
    )
    assert cluster.event_reasons(ns, "nb").count("GpuAttached") == 2
    assert api.delete("/v1/attachments").status == 204
    eventually(lambda: cluster.holders(ns) == [], "no holder left")


def test_tokens_rbac_and_subject_access_reviews_are_the_real_ones(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    ns, (owner, intruder) = notebooks(cluster, node_agent, "nb", "intruder")
    target = {"pod": {"namespace": ns, "name": "nb"}}
    (attachment,) = owner.post("/v1/attachments", {"count": 1}).json()["attachments"]

    answers = [
        intruder.post("/v1/attachments", {"count": 1, "target": target}),
        intruder.get(f"/v1/attachments?pod={ns}/nb"),
        intruder.delete(f"/v1/attachments/{attachment['uuid']}"),
    ]
    assert [(a.status, a.error) for a in answers] == [(403, "forbidden")] * 3
    tcp = node_agent.process.tcp
    assert tcp is not None
    assert tcp.with_token(None).post("/v1/attachments", {"count": 1}).status == 401
    other_audience = cluster.pod_token(ns, "nb", audience="https://kubernetes.default.svc")
    assert tcp.with_token(other_audience).post("/v1/attachments", {"count": 1}).status == 401

    # An operator: a ServiceAccount granted pods/gpus by a real Role and RoleBinding.
    cluster.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "op", "namespace": ns},
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "gpu-op", "namespace": ns},
                "rules": [
                    {
                        "apiGroups": [""],
                        "resources": ["pods/gpus"],
                        "verbs": ["get", "create", "delete"],
                    }
                ],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "gpu-op", "namespace": ns},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "gpu-op",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": ns}],
            },
        ]
    )
    token = cluster.kubectl("create", "token", "op", "-n", ns, "--audience=gpu-hotplug").strip()
    operator = tcp.with_token(token)
    assert (
        operator.get(f"/v1/attachments?pod={ns}/nb").json()["attachments"][0]["uuid"]
        == (attachment["uuid"])
    )
    assert operator.post("/v1/attachments", {"count": 1, "target": target}).status == 201
    assert operator.delete(f"/v1/attachments?pod={ns}/nb").status == 204
    eventually(lambda: cluster.holders(ns) == [], "the operator's detach removes the holders")


def test_the_pod_limit_and_the_namespace_quota_are_enforced(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    ns = cluster.namespace()
    cluster.run_notebook_pod(ns, "capped", annotations={MAX_GPUS: "1"})
    capped = node_agent.as_pod(ns, "capped")
    assert capped.post("/v1/attachments", {"count": 1}).status == 201
    over = capped.post("/v1/attachments", {"count": 1})
    assert (over.status, over.error, over.json()["limit"]) == (403, "forbidden", 1)

    quota_ns = cluster.namespace("quota")
    cluster.core.create_namespaced_resource_quota(
        quota_ns,
        {"metadata": {"name": "gpu-quota"}, "spec": {"hard": {"requests.nvidia.com/gpu": "1"}}},
    )
    cluster.run_notebook_pod(quota_ns, "nb")
    refused = node_agent.as_pod(quota_ns, "nb").post("/v1/attachments", {"count": 2})
    assert (refused.status, refused.error) == (403, "forbidden"), refused.body
    assert "gpu-quota" in refused.json()["message"]
    eventually(lambda: cluster.holders(quota_ns) == [], "no holder left by the refused attach")
    assert capped.delete("/v1/attachments").status == 204


def test_insufficient_gpus_is_409_and_leaves_no_holder(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    ns, (a, b) = notebooks(cluster, node_agent, "a", "b")
    total = cluster.node.gpu_count
    assert a.post("/v1/attachments", {"count": total - 1}).status == 201
    refused = b.post("/v1/attachments", {"count": 2})
    assert (refused.status, refused.error) == (409, "insufficient_gpus")
    assert (refused.json()["free"], refused.json()["requested"]) == (1, 2)
    eventually(lambda: len(cluster.holders(ns)) == total - 1, "only a's holders remain")
    assert a.delete("/v1/attachments").status == 204


def test_deleting_the_notebook_pod_garbage_collects_its_holders_and_frees_the_gpus(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    ns, (api,) = notebooks(cluster, node_agent, "nb")
    assert api.post("/v1/attachments", {"count": 2}).status == 201

    cluster.delete_pod(ns, "nb")

    eventually(lambda: cluster.holders(ns) == [], "the garbage collector deletes the holders")
    eventually(lambda: devices_of(cluster, ns) == set(), "the kubelet frees the GPUs")
    cluster.run_notebook_pod(ns, "next")
    assert node_agent.as_pod(ns, "next").get("/v1/gpus").status == 200
    eventually(
        lambda: all(
            g["state"] == "free"
            for g in node_agent.as_pod(ns, "next").get("/v1/gpus").json()["gpus"]
        ),
        "the agent lists every GPU as free again",
    )


def test_a_deleted_holder_is_revoked_from_the_container(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    ns, (api,) = notebooks(cluster, node_agent, "nb")
    kept, lost = api.post("/v1/attachments", {"count": 2}).json()["attachments"]
    assert ENXIO in cluster.open_device(ns, "nb", lost["minor"])

    cluster.delete_pod(ns, lost["holder"].split("/")[1], grace=0)

    eventually(
        lambda: EPERM in cluster.open_fresh_node(ns, "nb", lost["minor"]),
        "the lost holder's GPU is revoked",
    )
    eventually(
        lambda: (
            [a["uuid"] for a in api.get("/v1/attachments").json()["attachments"]] == [kept["uuid"]]
        ),
        "the lost GPU's reservation is dropped",
    )
    assert ENXIO in cluster.open_device(ns, "nb", kept["minor"])
    eventually(lambda: "GpuRevoked" in cluster.event_reasons(ns, "nb"), "a GpuRevoked Event")
    assert api.delete("/v1/attachments").status == 204


def test_a_container_restarted_by_the_kubelet_gets_its_gpu_again(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    ns, (api,) = notebooks(cluster, node_agent, "nb")
    (attachment,) = api.post("/v1/attachments", {"count": 1}).json()["attachments"]

    after = cluster.restart_container(ns, "nb")

    eventually(
        lambda: ENXIO in cluster.open_device(ns, "nb", attachment["minor"]),
        "the GPU is re-injected into the new container",
    )
    (holder,) = cluster.holders(ns)
    annotations = holder["metadata"]["annotations"]
    assert annotations["gpu-hotplug.jupyter.org/container-id"] == f"containerd://{after}"
    eventually(lambda: "GpuReinjected" in cluster.event_reasons(ns, "nb"), "GpuReinjected Event")
    assert api.delete("/v1/attachments").status == 204


@pytest.mark.parametrize("step", ["after_reserve", "after_grant"])
def test_kill_9_during_an_attach_then_restart_holds_nothing_twice(
    step: str, cluster: Cluster, agent_account: AgentAccount
) -> None:
    """Killed before the holders' one PATCH (``after_reserve``) the attach is rolled back;
    after it (``after_grant``) the holders say ``granted`` and the restart finishes it
    (``tests/k8s/test_agent_crash.py`` runs every step)."""
    ns = cluster.namespace()
    cluster.run_notebook_pod(ns, "nb")
    cluster.run_notebook_pod(ns, "other")
    with running_node_agent(cluster, agent_account) as agent:
        agent.process.stop()
        agent.process.start(env={"GPU_HOTPLUG_TEST_PAUSE_AT": step})
        api = agent.as_pod(ns, "nb")
        request = threading.Thread(
            target=lambda: _ignore_errors(api.post, "/v1/attachments", {"count": 2})
        )
        request.start()
        marker = marker_path(agent.process.state_dir, step)
        eventually(marker.exists, f"the attach pauses {step}")
        assert len(cluster.holders(ns)) == 2

        agent.process.kill9()
        request.join(timeout=WAIT)
        marker.unlink()
        agent.process.start(env={"GPU_HOTPLUG_TEST_PAUSE_AT": ""})

        kept = 2 if step == "after_grant" else 0
        eventually(lambda: len(cluster.holders(ns)) == kept, f"{kept} holder(s) after {step}")
        eventually(lambda: len(devices_of(cluster, ns)) == kept, "the kubelet agrees")
        api = agent.as_pod(ns, "nb")
        finished = api.get("/v1/attachments").json()["attachments"]
        assert {a["uuid"] for a in finished} == devices_of(cluster, ns)
        eventually(
            lambda: all(ENXIO in cluster.open_device(ns, "nb", a["minor"]) for a in finished),
            "the finished attach's GPUs are usable",
        )
        for minor in set(range(cluster.node.gpu_count)) - {a["minor"] for a in finished}:
            assert EPERM in cluster.open_fresh_node(ns, "nb", minor)
        mine = [] if kept else api.post("/v1/attachments", {"count": 2}).json()["attachments"]
        theirs = agent.as_pod(ns, "other").post("/v1/attachments", {"count": 2})
        assert theirs.status == 201, theirs.body
        uuids = [a["uuid"] for a in (*finished, *mine, *theirs.json()["attachments"])]
        assert len(set(uuids)) == 4 == len(devices_of(cluster, ns))
        for who in ("nb", "other"):
            assert agent.as_pod(ns, who).delete("/v1/attachments").status == 204
        eventually(lambda: cluster.holders(ns) == [], "every holder is gone")


def _ignore_errors(function: Callable[..., Any], *args: Any) -> None:
    """The request dies with the agent; its outcome is judged after the restart."""
    try:
        function(*args)
    except (ConnectionError, OSError):
        return


def test_a_holder_is_admitted_and_runs_in_a_podsecurity_restricted_namespace(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    """Real PodSecurity admission (``restricted``) and the real runc accept the agent's holder:
    non-root, seccomp RuntimeDefault, no capabilities, no privilege escalation, and limits the
    pause process and runc's init survive."""
    ns = cluster.namespace("strict", pod_security="restricted")
    cluster.run_notebook_pod(ns, "nb", restricted=True)
    api = node_agent.as_pod(ns, "nb")

    created = api.post("/v1/attachments", {"count": 1})

    assert created.status == 201, created.body
    (holder,) = cluster.holders(ns)
    assert holder["status"]["phase"] == "Running"
    (status,) = holder["status"]["containerStatuses"]
    assert status["restartCount"] == 0, status
    (attachment,) = created.json()["attachments"]
    assert ENXIO in cluster.open_device(ns, "nb", attachment["minor"])
    assert api.delete("/v1/attachments").status == 204


def test_the_kubelet_restarts_and_the_attached_gpu_stays_held_and_usable(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    """A kubelet restart (an upgrade, a crash) re-admits the running holders from its
    checkpoint and NVIDIA's plugin registers again: the GPU stays held, reported and usable,
    and attaching and detaching work through the new kubelet."""
    ns, (api,) = notebooks(cluster, node_agent, "nb")
    (kept,) = api.post("/v1/attachments", {"count": 1}).json()["attachments"]
    (holder,) = cluster.holders(ns)

    cluster.node.restart_kubelet()

    eventually(
        lambda: devices_of(cluster, ns) == {kept["uuid"]},
        "the restarted kubelet's PodResources names the held GPU",
    )
    (after,) = cluster.holders(ns)
    assert after["metadata"]["uid"] == holder["metadata"]["uid"]
    assert after["status"]["phase"] == "Running", after["status"]
    assert ENXIO in cluster.open_device(ns, "nb", kept["minor"])
    more = api.post("/v1/attachments", {"count": 1})
    assert more.status == 201, more.body
    (added,) = more.json()["attachments"]
    assert added["uuid"] != kept["uuid"]
    assert api.delete("/v1/attachments").status == 204
    eventually(lambda: cluster.holders(ns) == [], "no holder left")


def test_a_restarted_agent_rebuilds_its_attachment_from_the_holder_and_detaches_it(
    cluster: Cluster, agent_account: AgentAccount
) -> None:
    """An agent stopped and started again (a rolling update) with an attachment intact: it is
    rebuilt from the holder pod on the real API server, the GPU stays usable throughout, and
    the new agent detaches it."""
    ns = cluster.namespace()
    cluster.run_notebook_pod(ns, "nb")
    with running_node_agent(cluster, agent_account) as agent:
        created = agent.as_pod(ns, "nb").post("/v1/attachments", {"count": 1})
        assert created.status == 201, created.body
        (attachment,) = created.json()["attachments"]

        agent.process.stop()
        assert ENXIO in cluster.open_device(ns, "nb", attachment["minor"]), "kept while down"
        agent.process.start()

        api = agent.as_pod(ns, "nb")
        (listed,) = api.get("/v1/attachments").json()["attachments"]
        assert (listed["uuid"], listed["holder"]) == (attachment["uuid"], attachment["holder"])
        assert ENXIO in cluster.open_device(ns, "nb", attachment["minor"])
        assert devices_of(cluster, ns) == {attachment["uuid"]}
        assert api.delete(f"/v1/attachments/{attachment['uuid']}").status == 204
        assert cluster.holders(ns) == []
        assert EPERM in cluster.open_fresh_node(ns, "nb", attachment["minor"])
