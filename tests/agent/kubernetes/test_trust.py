"""Which holder pods the agent believes (``kubernetes/trust.py``), and one GPU one owner at
``HolderAllocator.load``: each forgery of issue 31 differs from the holder the agent builds in
one way, and is not believed for the reason named. The real-node counterpart, with the real
kubelet's PodResources and the admission policy, is ``tests/realnode/test_forgery.py``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Final, cast

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PodTarget
from jupyter_gpu_hotplug.agent.core.inventory import GpuDevice
from jupyter_gpu_hotplug.agent.kubernetes.allocator import HolderAllocator
from jupyter_gpu_hotplug.agent.kubernetes.holders import (
    ANNOTATION_CONTAINER_ID,
    ANNOTATION_TARGET,
    LABEL_CONTAINER,
    LABEL_HOLDER,
    LABEL_TARGET_UID,
    HolderSpec,
    gpu_annotations,
    holder_pod,
    read_holder,
)
from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeApi
from jupyter_gpu_hotplug.agent.kubernetes.node_pods import NodePods
from jupyter_gpu_hotplug.agent.kubernetes.podresources import PodDevices, PodResourcesClient
from jupyter_gpu_hotplug.agent.kubernetes.trust import (
    Distrust,
    Verdict,
    trusted_container_id,
    vet,
)

RESOURCE: Final = "nvidia.com/gpu"
UID: Final = "7d1f0c2a-3b4c-4d5e-8f90-a1b2c3d4e5f6"
CID: Final = "containerd://" + "ab" * 32
OLD_CID: Final = "containerd://" + "cd" * 32
MINE: Final = GpuUuid("GPU-11111111-1111-1111-1111-111111111111")
THEIRS: Final = GpuUuid("GPU-22222222-2222-2222-2222-222222222222")
GPUS: Final = {
    uuid: GpuDevice(uuid, index, index, "H100", 80 << 30, simulated=True)
    for index, uuid in enumerate((MINE, THEIRS))
}
NOTEBOOK: Final[dict[str, Any]] = {
    "metadata": {"namespace": "team-a", "name": "nb", "uid": UID},
    "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "notebook", "image": "j"}]},
    "status": {
        "containerStatuses": [
            {
                "name": "notebook",
                "containerID": CID,
                "lastState": {"terminated": {"containerID": OLD_CID}},
            }
        ]
    },
}


def _holder(uuid: GpuUuid = MINE, *, name: str = "") -> dict[str, Any]:
    """A holder of ``uuid`` as the agent builds and records it, running."""
    pod = holder_pod(
        NOTEBOOK,
        container="notebook",
        container_id=CID,
        request_id=None,
        index=0,
        spec=HolderSpec(node_name="gpu-node-1", resource_name=RESOURCE),
    )
    gpu = GPUS[uuid]
    pod["metadata"]["annotations"] |= gpu_annotations(
        uuid=uuid, index=gpu.index, minor=gpu.minor, name=gpu.name
    )
    pod["metadata"]["uid"] = f"holder-{name or uuid}"
    pod["metadata"]["name"] = name or pod["metadata"]["name"]
    pod["metadata"]["creationTimestamp"] = "2026-11-28T08:00:00Z"
    pod["status"] = {"phase": "Running"}
    return pod


def _assigned(pod: dict[str, Any], *device_ids: str) -> PodDevices:
    """What PodResources says of ``pod``: these ids of the GPU resource."""
    metadata = pod["metadata"]
    return PodDevices(metadata["namespace"], metadata["name"], {"hold": {RESOURCE: device_ids}})


def _verdict(pod: dict[str, Any], *device_ids: str, ended: bool = False) -> Verdict | None:
    return vet(
        pod,
        read_holder(pod),
        target_pod=NOTEBOOK,
        devices=_assigned(pod, *device_ids),
        resource_name=RESOURCE,
        gpus=GPUS,
        ended=ended,
    )


def test_the_agents_own_holder_is_believed() -> None:
    assert _verdict(_holder(), MINE) is None
    # A shared replica's id names its GPU.
    assert _verdict(_holder(), f"{MINE}::3") is None


def _no_gpu_request(pod: dict[str, Any]) -> None:
    for resources in pod["spec"]["containers"][0]["resources"].values():
        del resources[RESOURCE]


def _two_gpus(pod: dict[str, Any]) -> None:
    for resources in pod["spec"]["containers"][0]["resources"].values():
        resources[RESOURCE] = "2"


def _other_namespace(pod: dict[str, Any]) -> None:
    pod["metadata"]["annotations"][ANNOTATION_TARGET] = PodTarget("team-b", "nb", "notebook").key


def _no_owner(pod: dict[str, Any]) -> None:
    pod["metadata"]["ownerReferences"] = []


def _other_owner_uid(pod: dict[str, Any]) -> None:
    pod["metadata"]["labels"][LABEL_TARGET_UID] = "another-uid"
    pod["metadata"]["ownerReferences"][0]["uid"] = "another-uid"


def _other_container(pod: dict[str, Any]) -> None:
    pod["metadata"]["labels"][LABEL_CONTAINER] = "sidecar"


def _patched_to_their_gpu(pod: dict[str, Any]) -> None:
    gpu = GPUS[THEIRS]
    pod["metadata"]["annotations"] |= gpu_annotations(
        uuid=THEIRS, index=gpu.index, minor=gpu.minor, name=gpu.name
    )


def _patched_to_their_minor(pod: dict[str, Any]) -> None:
    pod["metadata"]["annotations"] |= {"gpu-hotplug.jupyter.org/minor": "1"}


def _no_annotations(pod: dict[str, Any]) -> None:
    pod["metadata"]["annotations"] = {}


FORGERIES: Final[dict[str, tuple[Callable[[dict[str, Any]], None], Distrust]]] = {
    "a notebook labelled as a holder": (_no_annotations, Distrust.UNREADABLE),
    "no GPU request (finding 1)": (_no_gpu_request, Distrust.REQUEST),
    "two GPUs requested": (_two_gpus, Distrust.REQUEST),
    "a target in another namespace (finding 3)": (_other_namespace, Distrust.NAMESPACE),
    "no owner": (_no_owner, Distrust.OWNER),
    "owned by another pod of that name": (_other_owner_uid, Distrust.OWNER),
    "another container than its label's": (_other_container, Distrust.OWNER),
    "patched to another GPU (finding 2)": (_patched_to_their_gpu, Distrust.DEVICE),
    "patched to another GPU's minor": (_patched_to_their_minor, Distrust.GPU),
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_holder_is_not_believed(forgery: str) -> None:
    pod = copy.deepcopy(_holder())
    change, reason = FORGERIES[forgery]
    change(pod)
    verdict = _verdict(pod, MINE)
    assert verdict is not None and verdict.reason is reason, verdict


@pytest.mark.parametrize("assigned", [(), (str(THEIRS),), (str(MINE), str(THEIRS))])
def test_the_kubelet_must_name_exactly_the_annotated_gpu(assigned: tuple[str, ...]) -> None:
    verdict = _verdict(_holder(), *assigned)
    assert verdict is not None and verdict.reason is Distrust.DEVICE, verdict


def test_an_ended_holder_needs_no_device_but_its_ownership() -> None:
    """The kubelet freed an evicted holder's device: its word still counts for its own
    namespace (the loss is handled), never for another's."""
    assert _verdict(_holder(), ended=True) is None
    pod = _holder()
    _other_namespace(pod)
    verdict = _verdict(pod, ended=True)
    assert verdict is not None and verdict.reason is Distrust.NAMESPACE


def test_a_pod_recreated_under_the_targets_name_is_not_the_owner() -> None:
    recreated = copy.deepcopy(NOTEBOOK)
    recreated["metadata"]["uid"] = "a-new-pod"
    pod = _holder()
    verdict = vet(
        pod,
        read_holder(pod),
        target_pod=recreated,
        devices=_assigned(pod, MINE),
        resource_name=RESOURCE,
        gpus=GPUS,
    )
    assert verdict is not None and verdict.reason is Distrust.OWNER


@pytest.mark.parametrize(
    ("annotated", "trusted"),
    [
        (CID, CID),  # the running container
        (OLD_CID, OLD_CID),  # the one the kubelet replaced: the reconciler re-injects
        ("containerd://" + "ee" * 32, CID),  # someone else's: the pod's own instead
        ("", CID),
    ],
)
def test_the_container_comes_from_the_pod(annotated: str, trusted: str) -> None:
    pod = _holder()
    pod["metadata"]["annotations"][ANNOTATION_CONTAINER_ID] = annotated
    holder = read_holder(pod)
    assert holder is not None
    assert trusted_container_id(holder, NOTEBOOK) == trusted


# --- one GPU, one owner: HolderAllocator.load ---------------------------------------------------


class _Pods:
    """The node's pods as ``NodePods`` serves ``load``."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self._pods = pods

    async def start(self) -> None:
        return None

    def listen(self, listener: Any) -> None:
        return None

    def pods(self) -> list[dict[str, Any]]:
        return self._pods

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return next(
            (
                p
                for p in self._pods
                if (p["metadata"]["namespace"], p["metadata"]["name"]) == (namespace, name)
            ),
            None,
        )


class _PodResources:
    def __init__(self, devices: list[PodDevices]) -> None:
        self.devices = devices

    def list(self) -> list[PodDevices]:
        return self.devices


async def _blocking(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


async def _load(pods: list[dict[str, Any]], devices: list[PodDevices]) -> tuple[Any, list[Any]]:
    """A fresh allocator loaded from ``pods``: it and what it reported untrusted."""
    allocator = HolderAllocator(
        # Holders that all learnt their GPU: load makes no API call (nothing to delete).
        kube=cast(KubeApi, None),
        pods=cast(NodePods, _Pods([NOTEBOOK, *pods])),
        podresources=cast(PodResourcesClient, _PodResources(devices)),
        spec=HolderSpec(node_name="gpu-node-1", resource_name=RESOURCE),
        blocking=_blocking,
    )
    reported: list[tuple[str, Distrust]] = []
    allocator.on_untrusted(lambda pod, v: reported.append((pod["metadata"]["name"], v.reason)))
    await allocator.load()
    return allocator, reported


async def test_a_second_claim_of_a_gpu_is_a_conflict_not_an_overwrite() -> None:
    """Two holders the kubelet both confirms for one GPU (shared replicas): the older keeps
    it, the other is reported."""
    first, second = _holder(name="first"), _holder(name="second")
    second["metadata"]["creationTimestamp"] = "2026-11-28T09:00:00Z"
    allocator, reported = await _load(
        [second, first], [_assigned(first, f"{MINE}::0"), _assigned(second, f"{MINE}::1")]
    )
    (entry,) = allocator.all_attachments()
    assert entry.holder == "team-a/first"
    assert reported == [("second", Distrust.CONFLICT)]


async def test_load_believes_only_what_the_kubelet_confirms() -> None:
    """Her holder patched to their GPU, a forged holder of a free GPU: neither is believed;
    the victim's is, and keeps its GPU."""
    theirs = _holder(THEIRS, name="theirs")
    patched = _holder(name="patched")
    _patched_to_their_gpu(patched)
    forged = _holder(name="forged")
    _no_gpu_request(forged)
    allocator, reported = await _load(
        [patched, forged, theirs], [_assigned(theirs, THEIRS), _assigned(patched, MINE)]
    )
    assert [entry.holder for entry in allocator.all_attachments()] == ["team-a/theirs"]
    assert sorted(reported) == [("forged", Distrust.REQUEST), ("patched", Distrust.DEVICE)]
    assert not allocator.trusts(patched) and allocator.trusts(theirs)


async def test_a_holder_someone_unlabelled_is_still_found_and_believed() -> None:
    """Its label is only the agent's selector: the kubelet's word decides, so the agent can
    still release it (issue 31, finding 5)."""
    unlabelled = _holder(name="unlabelled")
    del unlabelled["metadata"]["labels"][LABEL_HOLDER]
    allocator, reported = await _load([unlabelled], [_assigned(unlabelled, MINE)])
    assert [entry.holder for entry in allocator.all_attachments()] == ["team-a/unlabelled"]
    assert reported == []
