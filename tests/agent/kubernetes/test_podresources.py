"""The PodResources client against a real gRPC server on a unix socket, serving the kubelet's
wire messages (the kubelet itself cannot run here)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from jupyter_gpu_hotplug.agent.kubernetes.podresources import (
    PodResourcesClient,
    PodResourcesError,
    device_uuid,
)
from jupyter_gpu_hotplug.agent.kubernetes.protos import podresources_pb2 as pb

GPU = "nvidia.com/gpu"


def _pod(namespace: str, name: str, *containers: tuple[str, str, list[str]]) -> pb.PodResources:
    return pb.PodResources(
        namespace=namespace,
        name=name,
        containers=[
            pb.ContainerResources(
                name=container, devices=[pb.ContainerDevices(resource_name=res, device_ids=ids)]
            )
            for container, res, ids in containers
        ],
    )


PODS = [
    _pod("u1", "holder-a", ("hold", GPU, ["GPU-aaaa"])),
    _pod("u1", "holder-b", ("hold", GPU, ["GPU-bbbb::3"])),
    _pod("u2", "mig", ("hold", "nvidia.com/mig-1g.10gb", ["MIG-cccc"])),
]


class Kubelet:
    """A PodResources server with a switch for Get (off as with the feature gate disabled)."""

    def __init__(self, socket: Path, *, get_enabled: bool) -> None:
        self.socket = socket
        self.get_enabled = get_enabled
        self.calls: list[str] = []
        handlers = {
            "List": self._unary(self._list, pb.ListPodResourcesRequest),
            "Get": self._unary(self._get, pb.GetPodResourcesRequest),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v1.PodResourcesLister", handlers),)
        )
        self.server.add_insecure_port(f"unix://{socket}")

    @staticmethod
    def _unary(method: Callable[[Any, Any], Any], request: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            method,
            request_deserializer=request.FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )

    def _list(self, request: pb.ListPodResourcesRequest, context: Any) -> Any:
        self.calls.append("List")
        return pb.ListPodResourcesResponse(pod_resources=PODS)

    def _get(self, request: pb.GetPodResourcesRequest, context: Any) -> Any:
        self.calls.append("Get")
        if not self.get_enabled:
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        for pod in PODS:
            if (pod.namespace, pod.name) == (request.pod_namespace, request.pod_name):
                return pb.GetPodResourcesResponse(pod_resources=pod)
        context.abort(grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} not found")


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="podres-", dir="/tmp") as directory:
        yield Path(directory) / "kubelet.sock"


@pytest.fixture(params=[True, False], ids=["get", "get-disabled"])
def kubelet(request: pytest.FixtureRequest, socket_path: Path) -> Iterator[Kubelet]:
    server = Kubelet(socket_path, get_enabled=request.param)
    server.server.start()
    yield server
    server.server.stop(grace=None)


@pytest.fixture
def client(socket_path: Path) -> Iterator[PodResourcesClient]:
    client = PodResourcesClient(socket_path, timeout=5)
    yield client
    client.close()


def test_list_returns_every_pod_with_its_devices(
    kubelet: Kubelet, client: PodResourcesClient
) -> None:
    pods = {(p.namespace, p.name): p for p in client.list()}
    assert set(pods) == {("u1", "holder-a"), ("u1", "holder-b"), ("u2", "mig")}
    assert pods["u1", "holder-b"].containers == {"hold": {GPU: ("GPU-bbbb::3",)}}
    assert pods["u2", "mig"].device_ids("nvidia.com/mig-1g.10gb") == ["MIG-cccc"]
    assert pods["u2", "mig"].device_ids(GPU) == []


def test_get_finds_one_pod_and_falls_back_to_list_once_when_disabled(
    kubelet: Kubelet, client: PodResourcesClient
) -> None:
    assert client.get("u1", "holder-a") is not None
    pod = client.get("u1", "holder-b")
    assert pod is not None
    assert pod.device_ids(GPU) == ["GPU-bbbb::3"]
    if kubelet.get_enabled:
        assert kubelet.calls == ["Get", "Get"]
    else:
        assert kubelet.calls == ["Get", "List", "List"]


def test_get_of_an_unknown_pod_is_none(kubelet: Kubelet, client: PodResourcesClient) -> None:
    assert client.get("u1", "nope") is None
    assert client.get("u9", "holder-a") is None


def test_a_missing_kubelet_is_a_clear_error(client: PodResourcesClient) -> None:
    with pytest.raises(PodResourcesError, match="did not answer List: UNAVAILABLE"):
        client.list()
    with pytest.raises(PodResourcesError, match="did not answer Get"):
        client.get("u1", "holder-a")


@pytest.mark.parametrize(
    ("raw", "uuid"),
    [
        ("GPU-4f9b2c1e-0000-1111-2222-333344445555", "GPU-4f9b2c1e-0000-1111-2222-333344445555"),
        ("GPU-4f9b2c1e-0000-1111-2222-333344445555::7", "GPU-4f9b2c1e-0000-1111-2222-333344445555"),
        ("MIG-9d1b0f0a-aaaa-bbbb-cccc-ddddeeeeffff", "MIG-9d1b0f0a-aaaa-bbbb-cccc-ddddeeeeffff"),
    ],
)
def test_device_uuid_strips_the_replica_suffix(raw: str, uuid: str) -> None:
    assert device_uuid(raw) == uuid
