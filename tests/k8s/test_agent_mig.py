"""MIG slices in Kubernetes mode on the simulated node: what the real node cannot produce.

The agent runs with ``--resource-name nvidia.com/mig-1g.10gb`` on a simulated node whose GPU 0
is in MIG mode (``--simulate-mig``), the kubelet simulator advertises the same two slices, and
a notebook pod (a real containerd container) holds both. Attaching slices through NVIDIA's
own plugin and the real kubelet is proven on the real node (``tests/realnode/test_mig.py``);
this file keeps the one scenario that needs an evicted holder whose Failed object stays, which
the real kubelet does not produce on demand, and a pod whose plugin slice shares its GPU with a
hot-attached one (the tier's host has cgroup v1, where a deny removes an entry whoever added
it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.mig import Node, caps_nodes, open_script
from tests.fixtures.requirements import needs_root

from ..agent.agent_process import AgentProcess
from ..fixtures.device_messages import ENXIO, EPERM
from .agent import allow_in_cgroup, as_pod, eventually, running_k8s_agent
from .containerd import Containerd
from .fixtures import KubeletFactory
from .inventory import simulated_slices
from .kube import FakeKube
from .kubelet import KubeletSimulator

pytestmark = [*needs_root, pytest.mark.k8s, pytest.mark.slow]

NS = "team-mig"
RESOURCE = "nvidia.com/mig-1g.10gb"
PROFILES = ("1g.10gb", "1g.10gb")


@pytest.fixture
def mig_kubelet(kubelet_factory: KubeletFactory) -> KubeletSimulator:
    """A kubelet whose device plugin advertises the simulated node's two 1g slices."""
    return kubelet_factory(gpus=simulated_slices(2, PROFILES))


@pytest.fixture
def mig_agent(
    kube: FakeKube, mig_kubelet: KubeletSimulator, containerd: Containerd
) -> Iterator[AgentProcess]:
    with running_k8s_agent(
        kube,
        mig_kubelet,
        None,
        containerd,
        extra=(
            f"--resource-name={RESOURCE}",
            "--simulate=2",
            f"--simulate-mig={','.join(PROFILES)}",
        ),
    ) as process:
        yield process


def run(kubelet: KubeletSimulator, pod: str, script: str) -> str:
    result = kubelet.exec(NS, pod, "notebook", ["sh", "-c", script])
    return result.stdout + result.stderr


def opens(kubelet: KubeletSimulator, pod: str, node: Node) -> str:
    """What opening ``node`` says in the pod's container (``open_script``)."""
    return run(kubelet, pod, open_script(node))


def test_an_evicted_slice_holder_takes_only_that_slice_from_a_pod_holding_both(
    kube: FakeKube, mig_kubelet: KubeletSimulator, mig_agent: AgentProcess
) -> None:
    """Issue 23: one container holds both slices of GPU 0; the holder of one is evicted. The
    revoke must take that slice's two caps nodes and leave the parent ``/dev/nvidia0``, which
    the other slice still needs (the rule ``devices.revocable`` decides for every revoke)."""
    mig_kubelet.run_notebook_pod(NS, "nb")
    api = as_pod(mig_agent, kube, NS, "nb")
    answer = api.post("/v1/attachments", {"count": 2})
    assert answer.status == 201, answer.body
    kept, lost = answer.json()["attachments"]
    simulation = mig_agent.state_dir / "simulation"
    kept_caps = caps_nodes(simulation, kept["uuid"])
    lost_caps = caps_nodes(simulation, lost["uuid"])
    gpu: Node = ("/dev/nvidia0", 195, 0)
    for node in (gpu, *kept_caps, *lost_caps):
        assert ENXIO in opens(mig_kubelet, "nb", node), node

    mig_kubelet.evict(NS, lost["holder"].split("/")[1])

    def lost_slice_revoked() -> bool:
        return all(EPERM in opens(mig_kubelet, "nb", node) for node in lost_caps)

    eventually(lost_slice_revoked, "the evicted slice's caps nodes are revoked")
    for path, _, _ in lost_caps:
        assert "No such file" in run(mig_kubelet, "nb", f"ls {path}"), path
    eventually(
        lambda: (
            [a["uuid"] for a in api.get("/v1/attachments").json()["attachments"]] == [kept["uuid"]]
        ),
        "only the kept slice is still attached",
    )
    assert ENXIO in opens(mig_kubelet, "nb", gpu), "the kept slice still needs its GPU node"
    assert "unlink c 195:0" not in mig_agent.log(), "the shared GPU node was never taken"
    for node in kept_caps:
        assert ENXIO in opens(mig_kubelet, "nb", node), node


def test_detaching_a_slice_keeps_the_gpu_node_of_the_plugin_slice_beside_it(
    kube: FakeKube, mig_kubelet: KubeletSimulator, mig_agent: AgentProcess
) -> None:
    """The device plugin gave the pod one slice of GPU 0 at its start; the agent hot-attaches
    the other. Detaching it revokes its caps nodes and never ``/dev/nvidia0``, which the
    plugin's slice needs too (``Revoker.revocable`` keeps what the container was assigned)."""
    mig_kubelet.run_notebook_pod(NS, "nb", resources={"limits": {RESOURCE: "1"}})
    ((planned,),) = mig_kubelet.assignments()[(NS, "nb")].values()
    simulation = mig_agent.state_dir / "simulation"
    planned_caps = caps_nodes(simulation, planned)
    gpu: Node = ("/dev/nvidia0", 195, 0)
    for _, major, minor in (gpu, *planned_caps):  # as the NVIDIA runtime does at creation
        allow_in_cgroup(mig_kubelet, NS, "nb", f"c {major}:{minor} rwm")
    api = as_pod(mig_agent, kube, NS, "nb")
    answer = api.post("/v1/attachments", {"count": 1})
    assert answer.status == 201, answer.body
    (attached,) = answer.json()["attachments"]
    assert attached["uuid"] != planned, "the holder gets the slice the plugin did not give"
    attached_caps = caps_nodes(simulation, attached["uuid"])
    for node in (gpu, *planned_caps, *attached_caps):
        assert ENXIO in opens(mig_kubelet, "nb", node), node

    assert api.delete(f"/v1/attachments/{attached['uuid']}").status == 204

    for node in attached_caps:
        assert EPERM in opens(mig_kubelet, "nb", node), node
    for node in (gpu, *planned_caps):
        assert ENXIO in opens(mig_kubelet, "nb", node), f"the plugin's slice keeps {node}"
    assert "unlink c 195:0" not in mig_agent.log(), "the shared GPU node was never taken"
