"""The test side's CRI client: the calls a kubelet makes to run and stop a pod.

Why its own: the simulator must drive containerd exactly as a kubelet would (so the product's
CRI client meets the same containers), without sharing the product's code or proto. Methods
are called by their upstream paths; messages come from ``protos/k8stier_cri.proto``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

import grpc

from . import protos

SERVICE: Final = "/runtime.v1.RuntimeService/"
_TIMEOUT: Final = 60.0


def pb() -> ModuleType:
    """The CRI message module (``RunPodSandboxRequest`` ...)."""
    return protos.load("k8stier_cri")


@dataclass(frozen=True)
class ContainerInfo:
    """What ``ContainerStatus(verbose=true)`` says about a container."""

    id: str
    state: str
    """``CONTAINER_RUNNING``, ``CONTAINER_EXITED``..."""
    pid: int
    """Its init process in the host's pid namespace (0 once it exited)."""
    cgroups_path: str
    """``runtimeSpec.linux.cgroupsPath`` (cgroupfs driver: ``/<parent>/<id>``)."""
    exit_code: int
    started_at: int
    """Nanoseconds since the epoch."""
    info: dict[str, Any]
    """The whole verbose ``info["info"]`` JSON."""


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str


class CriClient:
    """Blocking CRI calls over containerd's socket (thread-safe, like its gRPC channel)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._channel = grpc.insecure_channel(endpoint)

    def close(self) -> None:
        self._channel.close()

    def call(self, method: str, request: Any, response: str, timeout: float = _TIMEOUT) -> Any:
        """Call ``RuntimeService/<method>``; the answer parsed as message ``response``."""
        stub = self._channel.unary_unary(
            SERVICE + method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=getattr(pb(), response).FromString,
        )
        return stub(request, timeout=timeout)

    def version(self) -> Any:
        return self.call("Version", pb().VersionRequest(version="v1"), "VersionResponse")

    def run_pod_sandbox(self, config: Any, runtime_handler: str = "") -> str:
        request = pb().RunPodSandboxRequest(config=config, runtime_handler=runtime_handler)
        return str(self.call("RunPodSandbox", request, "RunPodSandboxResponse").pod_sandbox_id)

    def stop_pod_sandbox(self, sandbox_id: str) -> None:
        request = pb().StopPodSandboxRequest(pod_sandbox_id=sandbox_id)
        self.call("StopPodSandbox", request, "StopPodSandboxResponse")

    def remove_pod_sandbox(self, sandbox_id: str) -> None:
        request = pb().RemovePodSandboxRequest(pod_sandbox_id=sandbox_id)
        self.call("RemovePodSandbox", request, "RemovePodSandboxResponse")

    def list_pod_sandboxes(self, labels: dict[str, str] | None = None) -> list[Any]:
        request = pb().ListPodSandboxRequest(filter=pb().PodSandboxFilter(label_selector=labels))
        return list(self.call("ListPodSandbox", request, "ListPodSandboxResponse").items)

    def create_container(self, sandbox_id: str, config: Any, sandbox_config: Any) -> str:
        request = pb().CreateContainerRequest(
            pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox_config
        )
        return str(self.call("CreateContainer", request, "CreateContainerResponse").container_id)

    def start_container(self, container_id: str) -> None:
        request = pb().StartContainerRequest(container_id=container_id)
        self.call("StartContainer", request, "StartContainerResponse")

    def stop_container(self, container_id: str, timeout: int = 0) -> None:
        request = pb().StopContainerRequest(container_id=container_id, timeout=timeout)
        self.call("StopContainer", request, "StopContainerResponse")

    def remove_container(self, container_id: str) -> None:
        request = pb().RemoveContainerRequest(container_id=container_id)
        self.call("RemoveContainer", request, "RemoveContainerResponse")

    def list_containers(self, sandbox_id: str = "") -> list[Any]:
        request = pb().ListContainersRequest(filter=pb().ContainerFilter(pod_sandbox_id=sandbox_id))
        return list(self.call("ListContainers", request, "ListContainersResponse").containers)

    def container_status(self, container_id: str) -> ContainerInfo:
        request = pb().ContainerStatusRequest(container_id=container_id, verbose=True)
        answer = self.call("ContainerStatus", request, "ContainerStatusResponse")
        info = json.loads(answer.info["info"]) if "info" in answer.info else {}
        spec = info.get("runtimeSpec", {})
        return ContainerInfo(
            id=answer.status.id,
            state=pb().ContainerState.Name(answer.status.state),
            pid=int(info.get("pid", 0)),
            cgroups_path=spec.get("linux", {}).get("cgroupsPath", ""),
            exit_code=answer.status.exit_code,
            started_at=answer.status.started_at,
            info=info,
        )

    def exec_sync(self, container_id: str, argv: list[str], timeout: int = 10) -> ExecResult:
        """Run ``argv`` inside the container (``kubectl exec``), wait for it to finish."""
        request = pb().ExecSyncRequest(container_id=container_id, cmd=argv, timeout=timeout)
        answer = self.call("ExecSync", request, "ExecSyncResponse", timeout=timeout + _TIMEOUT)
        return ExecResult(
            answer.exit_code,
            answer.stdout.decode(errors="replace"),
            answer.stderr.decode(errors="replace"),
        )

    def remove_all_pods(self) -> None:
        """Stop and remove every sandbox (and so every container): what teardown needs."""
        for sandbox in self.list_pod_sandboxes():
            self.stop_pod_sandbox(sandbox.id)
            self.remove_pod_sandbox(sandbox.id)
