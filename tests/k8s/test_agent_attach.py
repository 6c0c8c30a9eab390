"""Kubernetes mode end to end: the real agent (a subprocess) attaches GPUs to a notebook pod
whose container is a real containerd container, through holder pods that the simulated
kubelet admits and PodResources reports; access is proven from inside the container (ENXIO:
the cgroup allows the GPU's node; EPERM: it denies it)."""

from __future__ import annotations

import time

import pytest

from tests.fixtures.requirements import needs_root

from ..agent.agent_process import AgentProcess
from .agent import as_pod, event_reasons, holders
from .kube import FakeKube
from .kubelet import KubeletSimulator

pytestmark = [*needs_root, pytest.mark.k8s, pytest.mark.slow]

NS = "team-a"
ENXIO = "No such device or address"
EPERM = "Operation not permitted"


def open_node(kubelet: KubeletSimulator, pod: str, minor: int) -> str:
    """What opening /dev/nvidia<minor> inside the notebook container says."""
    result = kubelet.exec(NS, pod, "notebook", ["cat", f"/dev/nvidia{minor}"])
    return result.stdout + result.stderr


def open_fresh_node(kubelet: KubeletSimulator, pod: str, minor: int) -> str:
    """Make a node for the device ourselves (as a user could) and open it: the device cgroup
    alone decides."""
    script = f"mknod /tmp/probe{minor} c 195 {minor} && cat /tmp/probe{minor}"
    result = kubelet.exec(NS, pod, "notebook", ["sh", "-c", script])
    return result.stdout + result.stderr


def test_a_pod_attaches_two_gpus_and_detaches_one(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    notebook = kubelet.run_notebook_pod(NS, "nb")
    api = as_pod(k8s_agent, kube, NS, "nb")

    created = api.post("/v1/attachments", {"count": 2})

    assert created.status == 201, created.body
    attachments = created.json()["attachments"]
    assert len(attachments) == 2
    assert all(
        a["target"] == {"pod": {"namespace": NS, "name": "nb", "container": "notebook"}}
        for a in attachments
    )
    held = holders(kube, NS)
    assert {f"{NS}/{h['metadata']['name']}" for h in held} == {a["holder"] for a in attachments}
    for holder in held:
        assert holder["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": "nb",
                "uid": notebook["metadata"]["uid"],
                "controller": False,
                "blockOwnerDeletion": True,
            }
        ]
        (container,) = holder["spec"]["containers"]
        assert container["resources"]["requests"] == container["resources"]["limits"]
        assert holder["status"].get("qosClass", "Guaranteed") == "Guaranteed"
        assert holder["spec"]["nodeName"] == kubelet.node_name
    reported = {
        device
        for (namespace, _), containers in kubelet.assignments().items()
        if namespace == NS
        for devices in containers.values()
        for device in devices
    }
    assert reported == {a["uuid"] for a in attachments}
    for attachment in attachments:
        assert ENXIO in open_node(kubelet, "nb", attachment["minor"])

    first, second = attachments
    assert api.delete(f"/v1/attachments/{first['uuid']}").status == 204

    remaining = api.get("/v1/attachments").json()["attachments"]
    assert [a["uuid"] for a in remaining] == [second["uuid"]]
    assert [f"{NS}/{h['metadata']['name']}" for h in holders(kube, NS)] == [second["holder"]]
    assert "No such file" in open_node(kubelet, "nb", first["minor"])
    assert EPERM in open_fresh_node(kubelet, "nb", first["minor"])
    assert ENXIO in open_node(kubelet, "nb", second["minor"])
    # Events are written in the background: wait for them with an upper bound.
    deadline = time.monotonic() + 30
    while event_reasons(kube, NS, "nb").count("GpuDetached") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    reasons = event_reasons(kube, NS, "nb")
    assert (reasons.count("GpuAttached"), reasons.count("GpuDetached")) == (2, 1), reasons


def test_another_pods_token_may_not_touch_this_pod_but_an_operator_may(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    kubelet.run_notebook_pod(NS, "nb")
    kubelet.run_notebook_pod(NS, "intruder")
    owner = as_pod(k8s_agent, kube, NS, "nb")
    intruder = as_pod(k8s_agent, kube, NS, "intruder")
    target = {"pod": {"namespace": NS, "name": "nb"}}
    (attachment,) = owner.post("/v1/attachments", {"count": 1}).json()["attachments"]

    attach = intruder.post("/v1/attachments", {"count": 1, "target": target})
    listing = intruder.get(f"/v1/attachments?pod={NS}/nb")
    detach = intruder.delete(f"/v1/attachments/{attachment['uuid']}")
    detach_all = intruder.delete(f"/v1/attachments?pod={NS}/nb")
    assert [r.status for r in (attach, listing, detach, detach_all)] == [403] * 4
    assert all(r.error == "forbidden" for r in (attach, listing, detach, detach_all))
    assert len(holders(kube, NS)) == 1

    assert k8s_agent.tcp is not None
    kube.add_token(
        "operator-token", username="alice", groups=("gpu-operators",), audiences=("gpu-hotplug",)
    )
    kube.allow(
        verbs=("get", "create", "delete"), resources=("pods/gpus",), groups=("gpu-operators",)
    )
    operator = k8s_agent.tcp.with_token("operator-token")
    assert (
        operator.get(f"/v1/attachments?pod={NS}/nb").json()["attachments"][0]["uuid"]
        == (attachment["uuid"])
    )
    assert operator.post("/v1/attachments", {"count": 1, "target": target}).status == 201
    assert operator.delete(f"/v1/attachments?pod={NS}/nb").status == 204
    assert holders(kube, NS) == []


def test_no_token_or_a_token_for_another_audience_is_401(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    kubelet.run_notebook_pod(NS, "nb")
    assert k8s_agent.tcp is not None
    assert k8s_agent.tcp.with_token(None).post("/v1/attachments", {"count": 1}).status == 401
    wrong = k8s_agent.tcp.with_token(kube.pod_token(NS, "nb", audiences=("https://kubernetes",)))
    assert wrong.post("/v1/attachments", {"count": 1}).status == 401
    assert holders(kube, NS) == []
