"""The CRI client's parsing of runtime answers (recorded samples) and its errors against a real
gRPC server on a unix socket; the tier-3 tests run it against a real containerd."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from jupyter_gpu_hotplug.agent.kubernetes.cri import (
    CriClient,
    CriError,
    parse_info,
    split_container_id,
)
from jupyter_gpu_hotplug.agent.kubernetes.protos import cri_pb2 as pb

ID = "4c5e0f3d9a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5"

# The shapes containerd 1.6 (cgroupfs driver) and CRI-O (systemd driver) write (tier 3 checks
# containerd's real answer), trimmed to the keys that matter plus a few that do not.
CONTAINERD_INFO = json.dumps(
    {
        "sandboxID": "b" * 64,
        "pid": 4242,
        "removing": False,
        "snapshotKey": ID,
        "runtimeType": "io.containerd.runc.v2",
        "runtimeSpec": {
            "ociVersion": "1.0.2-dev",
            "process": {"args": ["/bin/sleep", "infinity"]},
            "linux": {"cgroupsPath": f"/kubepods/besteffort/podabc/{ID}", "namespaces": []},
        },
    }
)
CRIO_INFO = json.dumps(
    {
        "sandboxID": "c" * 64,
        "pid": 777,
        "runtimeSpec": {"linux": {"cgroupsPath": f"kubepods-podabc.slice:crio:{ID}"}},
        "privileged": False,
    }
)


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        ({"info": CONTAINERD_INFO}, (4242, f"/kubepods/besteffort/podabc/{ID}")),
        ({"info": CRIO_INFO}, (777, f"kubepods-podabc.slice:crio:{ID}")),
        ({}, (None, None)),
        ({"info": json.dumps({"pid": 0, "runtimeSpec": {}})}, (None, None)),
        ({"info": json.dumps({"pid": True, "runtimeSpec": None})}, (None, None)),
    ],
)
def test_parse_info(info: dict[str, str], expected: tuple[int | None, str | None]) -> None:
    assert parse_info(info) == expected


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]"])
def test_parse_info_refuses_what_is_not_a_json_object(raw: str) -> None:
    with pytest.raises(CriError, match="verbose container info"):
        parse_info({"info": raw})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (f"containerd://{ID}", ("containerd", ID)),
        (f"cri-o://{ID}", ("cri-o", ID)),
        (f"docker://{ID}", ("docker", ID)),
    ],
)
def test_split_container_id(value: str, expected: tuple[str, str]) -> None:
    assert split_container_id(value) == expected


@pytest.mark.parametrize("value", ["", ID, "rkt://x", "containerd://", "containerd://a/../b"])
def test_split_container_id_refuses_other_shapes(value: str) -> None:
    with pytest.raises(ValueError, match="not a container id"):
        split_container_id(value)


class Runtime:
    """A CRI endpoint answering ContainerStatus for one container, NOT_FOUND for the rest."""

    def __init__(self, socket: Path) -> None:
        def status(request: pb.ContainerStatusRequest, context: Any) -> Any:
            if request.container_id != ID:
                context.abort(grpc.StatusCode.NOT_FOUND, "container not found")
            assert request.verbose
            return pb.ContainerStatusResponse(
                status=pb.ContainerStatus(
                    id=ID,
                    metadata=pb.ContainerMetadata(name="notebook", attempt=1),
                    state=pb.CONTAINER_RUNNING,
                    started_at=1_700_000_000_000_000_000,
                ),
                info={"info": CONTAINERD_INFO},
            )

        def version(request: pb.VersionRequest, context: Any) -> Any:
            return pb.VersionResponse(
                version="0.1.0",
                runtime_name="containerd",
                runtime_version="1.6.20",
                runtime_api_version="v1",
            )

        def handler(method: Any, request: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(
                method,
                request_deserializer=request.FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "runtime.v1.RuntimeService",
                    {
                        "ContainerStatus": handler(status, pb.ContainerStatusRequest),
                        "Version": handler(version, pb.VersionRequest),
                    },
                ),
            )
        )
        self.server.add_insecure_port(f"unix://{socket}")


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="cri-", dir="/tmp") as directory:
        yield Path(directory) / "cri.sock"


def test_status_and_version_over_grpc(socket_path: Path) -> None:
    runtime = Runtime(socket_path)
    runtime.server.start()
    client = CriClient(str(socket_path), timeout=5)
    try:
        status = client.container_status(ID)
        assert status is not None
        assert (status.name, status.running, status.pid) == ("notebook", True, 4242)
        assert status.cgroups_path == f"/kubepods/besteffort/podabc/{ID}"
        assert client.container_status("f" * 64) is None
        assert client.version().name == "containerd"
    finally:
        client.close()
        runtime.server.stop(grace=None)


def test_an_absent_runtime_is_a_clear_error(socket_path: Path) -> None:
    client = CriClient(f"unix://{socket_path}", timeout=2)
    try:
        with pytest.raises(CriError, match="did not answer ContainerStatus: UNAVAILABLE"):
            client.container_status(ID)
    finally:
        client.close()
