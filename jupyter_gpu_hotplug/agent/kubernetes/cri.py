"""Client of the container runtime's CRI ``RuntimeService`` (containerd, CRI-O): where a
container runs on this host.

Why it exists: a pod's status names its containers by runtime id (``containerd://<id>``) but
says nothing the injector can use. ``ContainerStatus`` with ``verbose`` is the runtime's own
answer: whether the container runs, and in its ``info`` JSON (containerd and CRI-O both fill
``info["info"]``) the pid of the container's init process in the host's pid namespace and the
OCI ``runtimeSpec`` whose ``linux.cgroupsPath`` says where the runtime put it. ``Version``
names the runtime for logs and health.

Methods are called by their full upstream path (the messages live in our own proto package;
see ``protos/cri.proto``). Calls block, bounded by ``timeout``: run them in the worker pool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

import grpc

from .protos import cri_pb2 as pb

__all__ = [
    "ContainerRuntimeStatus",
    "CriClient",
    "CriError",
    "RuntimeVersion",
    "parse_info",
    "split_container_id",
]

_SERVICE: Final = "/runtime.v1.RuntimeService"
_SCHEMES: Final = ("containerd", "cri-o", "docker")


class CriError(Exception):
    """The container runtime could not be asked, or answered something unusable."""


@dataclass(frozen=True)
class RuntimeVersion:
    name: str
    version: str
    api_version: str


@dataclass(frozen=True)
class ContainerRuntimeStatus:
    """What the runtime says about one container."""

    id: str
    name: str
    state: str
    """The CRI state name: ``CONTAINER_RUNNING``, ``CONTAINER_EXITED``, ``CONTAINER_CREATED``
    or ``CONTAINER_UNKNOWN``."""
    started_at: int
    """Nanoseconds since the epoch; 0 when it never started."""
    reason: str
    pid: int | None
    """The container's init process in the host's pid namespace (None: the runtime did not say)."""
    cgroups_path: str | None
    """``runtimeSpec.linux.cgroupsPath`` as the runtime wrote it (cgroupfs path or systemd
    ``slice:prefix:name``); None when absent."""

    @property
    def running(self) -> bool:
        return self.state == "CONTAINER_RUNNING"


def split_container_id(value: str) -> tuple[str, str]:
    """``containerd://<id>`` (a pod status's ``containerID``) → ``("containerd", "<id>")``."""
    scheme, sep, container_id = value.partition("://")
    if not sep or scheme not in _SCHEMES or not container_id or "/" in container_id:
        raise ValueError(f"{value!r} is not a container id of a known runtime ({_SCHEMES})")
    return scheme, container_id


def parse_info(info: dict[str, str]) -> tuple[int | None, str | None]:
    """The pid and ``cgroupsPath`` in a verbose ``ContainerStatus`` ``info`` map; (None, None)
    for parts the runtime left out. ``CriError`` when ``info`` is there but not JSON."""
    raw = info.get("info")
    if not raw:
        return None, None
    try:
        document: Any = json.loads(raw)
    except ValueError as e:
        raise CriError(f"the runtime's verbose container info is not JSON: {raw[:200]!r}") from e
    if not isinstance(document, dict):
        raise CriError("the runtime's verbose container info is not a JSON object")
    pid = document.get("pid")
    spec = document.get("runtimeSpec")
    linux = spec.get("linux") if isinstance(spec, dict) else None
    path = linux.get("cgroupsPath") if isinstance(linux, dict) else None
    return (
        pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None,
        path if isinstance(path, str) and path else None,
    )


class CriClient:
    """``runtime.v1.RuntimeService`` over the runtime's unix socket; thread-safe."""

    def __init__(self, endpoint: str, *, timeout: float = 5.0) -> None:
        if endpoint.startswith("/"):
            endpoint = f"unix://{endpoint}"
        self._endpoint = endpoint
        self._timeout = timeout
        self._channel = grpc.insecure_channel(endpoint)
        self._version = self._channel.unary_unary(
            f"{_SERVICE}/Version",
            request_serializer=pb.VersionRequest.SerializeToString,
            response_deserializer=pb.VersionResponse.FromString,
        )
        self._status = self._channel.unary_unary(
            f"{_SERVICE}/ContainerStatus",
            request_serializer=pb.ContainerStatusRequest.SerializeToString,
            response_deserializer=pb.ContainerStatusResponse.FromString,
        )

    def close(self) -> None:
        self._channel.close()

    def version(self) -> RuntimeVersion:
        try:
            answer = self._version(pb.VersionRequest(version="v1"), timeout=self._timeout)
        except grpc.RpcError as e:
            raise self._error("Version", e) from e
        return RuntimeVersion(
            name=answer.runtime_name,
            version=answer.runtime_version,
            api_version=answer.runtime_api_version,
        )

    def container_status(self, container_id: str) -> ContainerRuntimeStatus | None:
        """The runtime's view of the container (bare id, no scheme); None if it has none."""
        request = pb.ContainerStatusRequest(container_id=container_id, verbose=True)
        try:
            answer = self._status(request, timeout=self._timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise self._error("ContainerStatus", e) from e
        status = answer.status
        pid, cgroups_path = parse_info(dict(answer.info))
        return ContainerRuntimeStatus(
            id=status.id or container_id,
            name=status.metadata.name,
            state=pb.ContainerState.Name(status.state),
            started_at=status.started_at,
            reason=status.reason,
            pid=pid,
            cgroups_path=cgroups_path,
        )

    def _error(self, method: str, error: grpc.RpcError) -> CriError:
        return CriError(
            f"the container runtime at {self._endpoint} did not answer {method}: "
            f"{error.code().name} {error.details()}"
        )
