"""The kubelet's PodResources API (``v1.PodResourcesLister`` ``List`` and ``Get``) served over
gRPC on a unix socket, from whatever the kubelet simulator reports as its running pods.

Why apart from the simulator: serving is gRPC's business (its own threads, method paths,
status codes), the simulator only knows which devices each running container holds. Answers
follow the kubelet: ``List`` has every active pod with all its containers (devices may be
empty), ``Get`` of an unknown pod is a plain Go error, i.e. gRPC ``UNKNOWN``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

from . import protos

SERVICE: Final = "v1.PodResourcesLister"


@dataclass(frozen=True)
class ContainerDevices:
    name: str
    resource: str
    """The extended resource the devices are of (``nvidia.com/gpu``); empty without any."""
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class PodDevices:
    namespace: str
    name: str
    containers: tuple[ContainerDevices, ...]


Snapshot = Callable[[], Sequence[PodDevices]]


def _message(pod: PodDevices) -> Any:
    p = protos.load("k8stier_podresources")
    containers = [
        p.ContainerResources(
            name=c.name,
            devices=[p.ContainerDevices(resource_name=c.resource, device_ids=c.device_ids)]
            if c.device_ids
            else [],
        )
        for c in pod.containers
    ]
    return p.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)


class PodResourcesServer:
    """Serves ``snapshot()`` (called on gRPC's threads: it must be thread-safe)."""

    def __init__(self, socket: Path, snapshot: Snapshot) -> None:
        self.socket = socket
        self._snapshot = snapshot
        self._server: grpc.Server | None = None
        self._lists = itertools.count()
        self.lists = 0
        """How many ``List`` calls were served (a waiting attach must not poll the kubelet)."""

    def start(self) -> None:
        p = protos.load("k8stier_podresources")

        def unary(function: Any, request: Any, response: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                function,
                request_deserializer=request.FromString,
                response_serializer=response.SerializeToString,
            )

        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "List": unary(self._list, p.ListPodResourcesRequest, p.ListPodResourcesResponse),
                "Get": unary(self._get, p.GetPodResourcesRequest, p.GetPodResourcesResponse),
            },
        )
        self._server = grpc.server(futures.ThreadPoolExecutor(4, thread_name_prefix="podres"))
        self._server.add_generic_rpc_handlers((handler,))
        self._server.add_insecure_port(f"unix://{self.socket}")
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1).wait(5)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def _list(self, request: Any, context: grpc.ServicerContext) -> Any:
        p = protos.load("k8stier_podresources")
        self.lists = next(self._lists) + 1
        return p.ListPodResourcesResponse(pod_resources=[_message(pod) for pod in self._snapshot()])

    def _get(self, request: Any, context: grpc.ServicerContext) -> Any:
        p = protos.load("k8stier_podresources")
        for pod in self._snapshot():
            if (pod.namespace, pod.name) == (request.pod_namespace, request.pod_name):
                return p.GetPodResourcesResponse(pod_resources=_message(pod))
        context.abort(
            grpc.StatusCode.UNKNOWN,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )
        raise AssertionError("context.abort returned")
