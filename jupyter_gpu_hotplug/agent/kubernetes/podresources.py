"""Client of the kubelet's PodResources API: which device ids the device plugin gave a pod.

Why it exists: a holder pod asks the scheduler for one GPU, but only the kubelet knows *which*
GPU its device plugin picked. The kubelet serves that on a node-local unix socket (by default
``/var/lib/kubelet/pod-resources/kubelet.sock``, gRPC ``v1.PodResourcesLister``). ``Get`` asks
for one pod; where the kubelet has it disabled (feature gate ``KubeletPodResourcesGet``, beta
only since 1.34) the client falls back to ``List`` once and remembers that.

Device ids are what the device plugin advertised: with NVIDIA's plugin a GPU UUID (``GPU-…``),
a MIG device UUID (``MIG-…``), or ``<UUID>::<n>`` for the n-th time-sliced replica of a GPU;
``device_uuid`` strips the replica suffix so the id names the physical device NVML knows.

Calls block (gRPC's sync API, bounded by ``timeout``): run them in the agent's worker pool.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import grpc

from .protos import podresources_pb2 as pb

__all__ = [
    "PodDevices",
    "PodResourcesClient",
    "PodResourcesError",
    "device_uuid",
]

_SERVICE: Final = "/v1.PodResourcesLister"
_REPLICA_SEPARATOR: Final = "::"
# Codes that mean "the kubelet is not answering", not "this method is off": no fallback helps.
_UNREACHABLE: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class PodResourcesError(Exception):
    """The kubelet's PodResources API could not be asked (socket missing, kubelet down)."""


def device_uuid(device_id: str) -> str:
    """The physical device a device-plugin id names: ``GPU-x::2`` (a shared replica) → ``GPU-x``."""
    return device_id.partition(_REPLICA_SEPARATOR)[0]


@dataclass(frozen=True)
class PodDevices:
    """The devices the kubelet assigned to one pod, per container and resource name."""

    namespace: str
    name: str
    containers: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    """container name → resource name → device ids, as the device plugin gave them."""

    def device_ids(self, resource_name: str) -> list[str]:
        """Every id of ``resource_name`` over all containers, in the kubelet's order."""
        return [
            device
            for resources in self.containers.values()
            for device in resources.get(resource_name, ())
        ]


def _pod_devices(message: pb.PodResources) -> PodDevices:
    containers: dict[str, dict[str, tuple[str, ...]]] = {}
    for container in message.containers:
        resources = containers.setdefault(container.name, {})
        for devices in container.devices:
            resources[devices.resource_name] = (
                *resources.get(devices.resource_name, ()),
                *devices.device_ids,
            )
    return PodDevices(namespace=message.namespace, name=message.name, containers=containers)


class PodResourcesClient:
    """``v1.PodResourcesLister`` over a unix socket; one channel, reused, thread-safe."""

    def __init__(self, socket: Path, *, timeout: float = 5.0) -> None:
        self._socket = socket
        self._timeout = timeout
        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self._list = self._channel.unary_unary(
            f"{_SERVICE}/List",
            request_serializer=pb.ListPodResourcesRequest.SerializeToString,
            response_deserializer=pb.ListPodResourcesResponse.FromString,
        )
        self._get = self._channel.unary_unary(
            f"{_SERVICE}/Get",
            request_serializer=pb.GetPodResourcesRequest.SerializeToString,
            response_deserializer=pb.GetPodResourcesResponse.FromString,
        )
        self._get_works = True
        self._lock = threading.Lock()

    def close(self) -> None:
        self._channel.close()

    def list(self) -> list[PodDevices]:
        """Every pod the kubelet has admitted on this node."""
        try:
            answer = self._list(pb.ListPodResourcesRequest(), timeout=self._timeout)
        except grpc.RpcError as e:
            raise self._error("List", e) from e
        return [_pod_devices(pod) for pod in answer.pod_resources]

    def get(self, namespace: str, name: str) -> PodDevices | None:
        """The pod's devices, or None when the kubelet does not know the pod (yet, or any more)."""
        if self._get_works:
            request = pb.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace)
            try:
                answer = self._get(request, timeout=self._timeout)
            except grpc.RpcError as e:
                if e.code() in _UNREACHABLE:
                    raise self._error("Get", e) from e
                # The kubelet answers an unknown pod and a disabled Get alike (code UNKNOWN
                # with a message); List tells both apart, and a disabled Get stays disabled.
                if e.code() == grpc.StatusCode.UNIMPLEMENTED or "disabled" in str(e.details()):
                    with self._lock:
                        self._get_works = False
            else:
                pod = _pod_devices(answer.pod_resources)
                if (pod.namespace, pod.name) == (namespace, name):
                    return pod
        return next(
            (pod for pod in self.list() if (pod.namespace, pod.name) == (namespace, name)), None
        )

    def _error(self, method: str, error: grpc.RpcError) -> PodResourcesError:
        return PodResourcesError(
            f"the kubelet's PodResources API on {self._socket} did not answer {method}: "
            f"{error.code().name} {error.details()}"
        )
