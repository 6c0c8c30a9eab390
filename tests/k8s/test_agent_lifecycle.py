"""Kubernetes mode end to end where the real node (``tests/realnode/test_attach.py``) cannot
go on demand: a VM sandbox (no Kata or gVisor runtime there), a holder held Pending past the
request's deadline, and a holder evicted by node pressure (its Failed object left behind). The
scenarios both tiers can express — attach and detach, tokens and RBAC, the max-gpus annotation
and quota, 409, garbage collection, a deleted holder, a restarted container, ``kill -9`` during
an attach, an agent restarted with its attachment intact — run on the real node only
(docs/testing.md, "What the simulated tier keeps"; ``kill -9`` at every step of an attach and
a detach also runs here: ``test_agent_crash.py``).

The real agent runs as a subprocess; containers are real (containerd + runc); the control plane
and kubelet are the tier's (``tests/k8s/README.md``). Waits have generous upper bounds and are
never asserted."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.requirements import needs_root

from ..agent.agent_process import AgentProcess
from ..fixtures.device_messages import ENXIO, EPERM
from .agent import as_pod, devices_of, event_reasons, eventually, holders
from .kube import FakeKube
from .kubelet import KubeletSimulator

pytestmark = [*needs_root, pytest.mark.k8s, pytest.mark.slow]

NS = "team-b"


def open_node(kubelet: KubeletSimulator, pod: str, minor: int) -> str:
    result = kubelet.exec(NS, pod, "notebook", ["cat", f"/dev/nvidia{minor}"])
    return result.stdout + result.stderr


def open_fresh_node(kubelet: KubeletSimulator, pod: str, minor: int) -> str:
    script = f"mknod /tmp/p{minor} c 195 {minor} 2>&1; cat /tmp/p{minor}; rm -f /tmp/p{minor}"
    result = kubelet.exec(NS, pod, "notebook", ["sh", "-c", script])
    return result.stdout + result.stderr


# --- refusals -------------------------------------------------------------------------------


def test_a_vm_sandbox_gets_422(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    """The real node has no Kata or gVisor runtime; the simulator reports such a pod Running
    with container ids that never reach runc."""
    kube.create_runtime_class("kata", "kata-qemu")
    kubelet.run_notebook_pod(NS, "vm", runtime_class="kata")
    refused = as_pod(k8s_agent, kube, NS, "vm").post("/v1/attachments", {"count": 1})
    assert (refused.status, refused.error) == (422, "target_not_ready")
    assert "kata" in refused.json()["message"]
    assert holders(kube, NS) == []


def test_a_holder_that_does_not_run_in_time_is_504_and_leaves_nothing(
    kube: FakeKube,
    kubelet: KubeletSimulator,
    k8s_agent: AgentProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real kubelet admits a holder within a second or two; only the simulator can keep it
    Pending past ``wait_seconds`` on demand."""
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


# --- holders and the agent come and go -------------------------------------------------------


def test_an_evicted_holder_is_revoked_from_the_container_at_once(
    kube: FakeKube, kubelet: KubeletSimulator, k8s_agent: AgentProcess
) -> None:
    """Node-pressure eviction: the holder is Failed/Evicted and its object stays (a deleted
    holder is the real node's ``test_a_deleted_holder_is_revoked_from_the_container``)."""
    kubelet.run_notebook_pod(NS, "nb")
    api = as_pod(k8s_agent, kube, NS, "nb")
    kept, lost = api.post("/v1/attachments", {"count": 2}).json()["attachments"]
    assert ENXIO in open_node(kubelet, "nb", lost["minor"])

    kubelet.evict(NS, lost["holder"].split("/")[1])

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
