"""MIG slices through NVIDIA's device plugin on the real node.

The node's fifth GPU is in MIG mode with two ``1g.10gb`` slices (the simulated NVML), and the
driver's tables (``/proc/driver/nvidia-caps/mig-minors``, the ``nvidia-caps`` major) are
bound where a node has them, in a mount namespace that NVIDIA's plugin and the agent share
(``RealNode.in_driver_namespace``). The plugin's ``mixed`` strategy turns the slices into
``nvidia.com/mig-1g.10gb`` with its own code — profile naming from NVML's profile tables, the
capability paths from ``mig-minors`` — the real kubelet's device manager assigns them to the
holder pods, and an agent started with ``--resource-name=nvidia.com/mig-1g.10gb`` injects each
slice (its GPU's node and its two ``nvidia-caps`` nodes) into the notebook that asked.

Access is proven from inside each container: ENXIO where the device cgroup allows a node (no
driver answers), EPERM where it denies it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..fixtures.device_messages import ENXIO, EPERM
from ..fixtures.mig import Node, open_script, slice_caps_nodes
from ..fixtures.requirements import needs_root
from .agent import AgentAccount, NodeAgent, running_node_agent
from .cluster import Cluster, eventually
from .node import GPU_RESOURCE, MIG_PROFILES, MIG_RESOURCE

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]


@pytest.fixture
def mig_agent(cluster: Cluster, agent_account: AgentAccount) -> Iterator[NodeAgent]:
    with running_node_agent(
        cluster, agent_account, extra=(f"--resource-name={MIG_RESOURCE}",)
    ) as agent:
        yield agent


def run(cluster: Cluster, ns: str, pod: str, script: str) -> str:
    result = cluster.exec(ns, pod, ["sh", "-c", script])
    return result.stdout + result.stderr


def opens(cluster: Cluster, ns: str, pod: str, node: Node) -> str:
    """What opening ``node`` says in the notebook (``open_script``)."""
    return run(cluster, ns, pod, open_script(node))


def test_nvidia_plugin_serves_the_slices_beside_the_whole_gpus(cluster: Cluster) -> None:
    allocatable = cluster.node.kubectl_json("get", "node", cluster.node_name)["status"][
        "allocatable"
    ]

    assert allocatable[MIG_RESOURCE] == str(len(MIG_PROFILES))
    assert allocatable[GPU_RESOURCE] == str(cluster.node.gpu_count), "the MIG GPU is not whole"
    assert f"Registered device plugin for '{MIG_RESOURCE}'" in cluster.node.log_tail(
        "nvidia-device-plugin", 10**6
    )


def test_two_pods_each_attach_one_slice_and_see_only_their_own(
    cluster: Cluster, mig_agent: NodeAgent
) -> None:
    node = cluster.node
    assert node.nvml_config is not None
    mig_gpu = node.nvml_config.gpus[-1]
    slices = {str(device.uuid) for device in mig_gpu.mig_devices}
    ns = cluster.namespace("mig")
    pods = ("nb-one", "nb-two")
    for pod in pods:
        cluster.run_notebook_pod(ns, pod)

    answers = [mig_agent.as_pod(ns, pod).post("/v1/attachments", {"count": 1}) for pod in pods]

    assert [a.status for a in answers] == [201, 201], [a.body for a in answers]
    (one,), (two,) = (a.json()["attachments"] for a in answers)
    assert {one["uuid"], two["uuid"]} == slices
    gpu: Node = (f"/dev/nvidia{mig_gpu.minor}", 195, mig_gpu.minor)
    assert one["minor"] == two["minor"] == mig_gpu.minor and one["device"] == gpu[0]
    # NVIDIA's plugin chose the slices: the real kubelet reports them, in List and in Get.
    for holder in cluster.holders(ns):
        (container,) = holder["spec"]["containers"]
        assert container["resources"]["limits"][MIG_RESOURCE] == "1"
        assert GPU_RESOURCE not in container["resources"]["limits"]
    holder_of = {a["uuid"]: a["holder"].split("/")[1] for a in (one, two)}
    assert cluster.assignments(ns, MIG_RESOURCE) == {
        (ns, name): {uuid} for uuid, name in holder_of.items()
    }
    for attachment in (one, two):
        uuid = attachment["uuid"]
        assert cluster.podresources_get(ns, holder_of[uuid], MIG_RESOURCE) == {uuid}
    own = {
        pod: slice_caps_nodes(
            node.nvml_config,
            attachment["uuid"],
            proc_devices=node.proc_devices,
            mig_minors=node.mig_minors,
        )
        for pod, attachment in (("nb-one", one), ("nb-two", two))
    }
    for pod, other in (("nb-one", "nb-two"), ("nb-two", "nb-one")):
        assert ENXIO in opens(cluster, ns, pod, gpu)
        listed_caps = run(cluster, ns, pod, "ls /dev/nvidia-caps").split()
        assert sorted(listed_caps) == sorted(p.rsplit("/", 1)[1] for p, _, _ in own[pod])
        for caps in own[pod]:
            assert ENXIO in opens(cluster, ns, pod, caps), caps
        for caps in own[other]:
            assert EPERM in opens(cluster, ns, pod, caps), caps
    wrong = mig_agent.as_pod(ns, "nb-one").post("/v1/attachments", {"count": 1, "mig": "2g.20gb"})
    assert (wrong.status, wrong.json()["field"]) == (400, "mig"), wrong.body

    detached = mig_agent.as_pod(ns, "nb-one").delete(f"/v1/attachments/{one['uuid']}")

    assert detached.status == 204, detached.body
    assert [h["metadata"]["name"] for h in cluster.holders(ns)] == [holder_of[two["uuid"]]]
    for caps in (gpu, *own["nb-one"]):
        assert EPERM in opens(cluster, ns, "nb-one", caps), caps
    for path in (gpu[0], *(p for p, _, _ in own["nb-one"])):
        assert "No such file" in run(cluster, ns, "nb-one", f"ls {path}"), path
    assert ENXIO in opens(cluster, ns, "nb-two", gpu)
    for caps in own["nb-two"]:
        assert ENXIO in opens(cluster, ns, "nb-two", caps), caps
    eventually(
        lambda: (
            cluster.assignments(ns, MIG_RESOURCE) == {(ns, holder_of[two["uuid"]]): {two["uuid"]}}
        ),
        "the kubelet has freed the detached slice",
    )
