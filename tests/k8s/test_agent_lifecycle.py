"""Kubernetes mode end to end, beyond one attach: limits and refusals, what happens when pods
and containers come and go, and a crash in the middle of an attach. The real agent runs as a
subprocess; containers are real (containerd + runc); the control plane and kubelet are the
tier's (``tests/k8s/README.md``). Waits have generous upper bounds and are never asserted."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from jupyter_gpu_hotplug.agent.core.checkpoints import marker_path
from tests.fixtures.requirements import needs_root

from ..agent.agent_process import AgentProcess
from .agent import WAIT, as_pod, event_reasons, eventually, holders, notebook_with_one_gpu
from .kube import FakeKube
from .kubelet import KubeletSimulator

pytestmark = [*needs_root, pytest.mark.k8s, pytest.mark.slow]

NS = "team-b"
ENXIO = "No such device or address"
EPERM = "Operation not permitted"


def open_node(kubelet: KubeletSimulator, pod: str, minor: int) -> str:
    result = kubelet.exec(NS, pod, "notebook", ["cat", f"/dev/nvidia{minor}"])
    return result.stdout + result.stderr


def open_fresh_node(kubelet: KubeletSimulator, pod: str, minor: int) -> str:
    script = f"mknod /tmp/p{minor} c 195 {minor} 2>&1; cat /tmp/p{minor}; rm -f /tmp/p{minor}"
    result = kubelet.exec(NS, pod, "notebook", ["sh", "-c", script])
    return result.stdout + result.stderr


def devices_of(kubelet: KubeletSimulator, namespace: str) -> set[str]:
    return {
        device
        for (ns, _), containers in kubelet.assignments().items()
        if ns == namespace
        for devices in containers.values()
        for device in devices
    }


# --- refusals -------------------------------------------------------------------------------


def test_max_gpus_annotation_and_namespace_quota_are_enforced(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    kubelet.run_notebook_pod(NS, "capped", annotations={"gpu-hotplug.jupyter.org/max-gpus": "1"})
    capped = as_pod(k8s_agent, kube, NS, "capped")
    assert capped.post("/v1/attachments", {"count": 1}).status == 201
    over = capped.post("/v1/attachments", {"count": 1})
    assert (over.status, over.error) == (403, "forbidden")
    assert over.json()["limit"] == 1

    kubelet.run_notebook_pod("quota-ns", "nb")
    kube.set_quota("quota-ns", "gpu-quota", {"requests.nvidia.com/gpu": "1"})
    api = as_pod(k8s_agent, kube, "quota-ns", "nb")
    refused = api.post("/v1/attachments", {"count": 2})
    assert (refused.status, refused.error) == (403, "forbidden")
    assert "gpu-quota" in refused.json()["message"]
    assert holders(kube, "quota-ns") == []
    assert len(holders(kube, NS)) == 1


def test_a_vm_sandbox_gets_422(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    kube.create_runtime_class("kata", "kata-qemu")
    kubelet.run_notebook_pod(NS, "vm", runtime_class="kata")
    refused = as_pod(k8s_agent, kube, NS, "vm").post("/v1/attachments", {"count": 1})
    assert (refused.status, refused.error) == (422, "target_not_ready")
    assert "kata" in refused.json()["message"]
    assert holders(kube, NS) == []


def test_insufficient_gpus_is_409_with_free_and_requested_and_leaves_no_holder(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    kubelet.run_notebook_pod(NS, "a")
    kubelet.run_notebook_pod(NS, "b")
    assert as_pod(k8s_agent, kube, NS, "a").post("/v1/attachments", {"count": 3}).status == 201
    refused = as_pod(k8s_agent, kube, NS, "b").post("/v1/attachments", {"count": 2})
    assert (refused.status, refused.error) == (409, "insufficient_gpus")
    assert (refused.json()["free"], refused.json()["requested"]) == (1, 2)
    eventually(lambda: len(holders(kube, NS)) == 3, "only a's three holders remain")


def test_a_holder_that_does_not_run_in_time_is_504_and_leaves_nothing(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    k8s_agent: AgentProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kubelet.run_notebook_pod(NS, "nb")
    admit = kubelet._admit_and_run

    async def slow_for_holders(pod: dict[str, Any]) -> None:
        """As while the pause image is pulled: holder pods stay Pending."""
        if (pod["metadata"].get("labels") or {}).get("gpu-hotplug.jupyter.org/holder"):
            return
        await admit(pod)

    monkeypatch.setattr(kubelet, "_admit_and_run", slow_for_holders)
    late = as_pod(k8s_agent, kube, NS, "nb").post(
        "/v1/attachments", {"count": 1, "wait_seconds": 2}
    )
    assert (late.status, late.error) == (504, "timeout")
    assert holders(kube, NS) == []
    assert devices_of(kubelet, NS) == set()


# --- pods and containers come and go ---------------------------------------------------------


def test_deleting_the_notebook_pod_collects_its_holders_and_the_agent_forgets_them(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    kubelet.run_notebook_pod(NS, "nb")
    assert as_pod(k8s_agent, kube, NS, "nb").post("/v1/attachments", {"count": 2}).status == 201
    assert k8s_agent.tcp is not None

    kube.delete_pod(NS, "nb")

    eventually(lambda: holders(kube, NS) == [], "the garbage collector deletes the holders")
    eventually(lambda: devices_of(kubelet, NS) == set(), "the kubelet frees the GPUs")

    kube.add_token("viewer", username="viewer", audiences=("gpu-hotplug",))
    viewer = k8s_agent.tcp.with_token("viewer")

    def agent_forgot() -> bool:
        gpus = viewer.get("/v1/gpus")
        return gpus.status == 200 and all(g["state"] == "free" for g in gpus.json()["gpus"])

    eventually(agent_forgot, "the agent lists every GPU as free again")


@pytest.mark.parametrize("how", ["evicted", "deleted"])
def test_a_lost_holder_is_revoked_from_the_container_at_once(
    how: str, kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    kubelet.run_notebook_pod(NS, "nb")
    api = as_pod(k8s_agent, kube, NS, "nb")
    kept, lost = api.post("/v1/attachments", {"count": 2}).json()["attachments"]
    assert ENXIO in open_node(kubelet, "nb", lost["minor"])

    name = lost["holder"].split("/")[1]
    if how == "evicted":
        # As node-pressure eviction: Failed/Evicted, the object left for whoever cleans up.
        kubelet.evict(NS, name, delete=False)
    else:
        kube.delete_pod(NS, name)

    eventually(
        lambda: EPERM in open_fresh_node(kubelet, "nb", lost["minor"]),
        "the evicted holder's GPU is revoked",
    )
    assert "No such file" in open_node(kubelet, "nb", lost["minor"])
    eventually(
        lambda: (
            [a["uuid"] for a in api.get("/v1/attachments").json()["attachments"]] == [kept["uuid"]]
        ),
        "the lost GPU's reservation is dropped once its holder is gone",
    )
    assert ENXIO in open_node(kubelet, "nb", kept["minor"])
    eventually(lambda: "GpuRevoked" in event_reasons(kube, NS, "nb"), "a GpuRevoked Event")


def test_a_restarted_notebook_container_gets_its_gpus_again(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    kubelet.run_notebook_pod(NS, "nb")
    api = as_pod(k8s_agent, kube, NS, "nb")
    (attachment,) = api.post("/v1/attachments", {"count": 1}).json()["attachments"]
    before = kubelet.container_id(NS, "nb", "notebook")

    after = kubelet.restart_container(NS, "nb", "notebook")

    assert after != before
    eventually(
        lambda: ENXIO in open_node(kubelet, "nb", attachment["minor"]),
        "the GPU is re-injected into the new container",
    )
    (holder,) = holders(kube, NS)
    annotations = holder["metadata"]["annotations"]
    assert annotations["gpu-hotplug.jupyter.org/container-id"] == f"containerd://{after}"
    assert [a["uuid"] for a in api.get("/v1/attachments").json()["attachments"]] == [
        attachment["uuid"]
    ]
    eventually(lambda: "GpuReinjected" in event_reasons(kube, NS, "nb"), "a GpuReinjected Event")


# --- a crash in the middle -------------------------------------------------------------------


@pytest.mark.parametrize("step", ["after_reserve", "after_grant"])
def test_kill_9_during_an_attach_then_restart_holds_nothing_twice_and_leaks_nothing(
    step: str, kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    kubelet.run_notebook_pod(NS, "nb")
    kubelet.run_notebook_pod(NS, "other")
    k8s_agent.stop()
    k8s_agent.start(env={"GPU_HOTPLUG_TEST_PAUSE_AT": step})
    api = as_pod(k8s_agent, kube, NS, "nb")
    request = threading.Thread(
        target=lambda: _ignore_errors(api.post, "/v1/attachments", {"count": 2})
    )
    request.start()
    marker = marker_path(k8s_agent.state_dir, step)
    eventually(marker.exists, f"the attach pauses {step}")
    assert len(holders(kube, NS)) == 2

    k8s_agent.kill9()
    request.join(timeout=WAIT)
    marker.unlink()
    k8s_agent.start(env={"GPU_HOTPLUG_TEST_PAUSE_AT": ""})

    eventually(lambda: holders(kube, NS) == [], "the interrupted attach is rolled back")
    eventually(lambda: devices_of(kubelet, NS) == set(), "the kubelet frees its GPUs")
    for minor in range(len(kubelet.gpus)):
        assert EPERM in open_fresh_node(kubelet, "nb", minor)
    mine = as_pod(k8s_agent, kube, NS, "nb").post("/v1/attachments", {"count": 2})
    theirs = as_pod(k8s_agent, kube, NS, "other").post("/v1/attachments", {"count": 2})
    assert (mine.status, theirs.status) == (201, 201)
    uuids = [a["uuid"] for r in (mine, theirs) for a in r.json()["attachments"]]
    assert len(set(uuids)) == 4 == len(devices_of(kubelet, NS))


def _ignore_errors(function: Callable[..., Any], *args: Any) -> None:
    """The request dies with the agent; its outcome is judged after the restart."""
    try:
        function(*args)
    except (ConnectionError, OSError):
        return


def test_a_restarted_agent_rebuilds_its_attachments_from_the_holder_pods(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    attachment = notebook_with_one_gpu(k8s_agent, kube, kubelet, NS, "nb")

    k8s_agent.stop()
    k8s_agent.start()

    api = as_pod(k8s_agent, kube, NS, "nb")
    (listed,) = api.get("/v1/attachments").json()["attachments"]
    assert (listed["uuid"], listed["holder"]) == (attachment["uuid"], attachment["holder"])
    assert ENXIO in open_node(kubelet, "nb", attachment["minor"])
    assert api.delete(f"/v1/attachments/{attachment['uuid']}").status == 204
    assert holders(kube, NS) == []
    assert EPERM in open_fresh_node(kubelet, "nb", attachment["minor"])
