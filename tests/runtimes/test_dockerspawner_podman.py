"""DockerSpawner, unchanged, starts a user container through podman's Docker-compatible API,
configured by ``configure_dockerspawner``, and that container gets a GPU from the local agent.

The container's own command calls the agent at the ``GPU_HOTPLUG_AGENT_URL`` the helper put in
its environment, over the socket directory the helper bound, with no token. What the container
can open is then asked through ``podman exec`` (a new process in the same cgroups and mount
namespace). Only ``get_ip_and_port`` is replaced: these containers have no network (no CNI
here), and reaching the single-user server is not what is tested.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dockerspawner import DockerSpawner
from traitlets.config import Config

from jupyter_gpu_hotplug.spawner import configure_dockerspawner
from tests.agent.agent_process import AgentProcess
from tests.fixtures.requirements import needs_root
from tests.spawner.docker_support import docker_spawner

from .containers import TESTS_DIR
from .podman import IMAGE, Podman, podman_missing_reason

pytestmark = [
    *needs_root,
    pytest.mark.slow,
    pytest.mark.skipif(podman_missing_reason() is not None, reason=str(podman_missing_reason())),
]

REPLY_TIMEOUT = 60.0
OPEN_GPU = """
import errno, os, sys
try:
    os.close(os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK))
except OSError as e:
    print(errno.errorcode[e.errno])
else:
    print("OK")
"""
# busybox sh: call the agent at the URL from the environment, then stay up like a server would.
ATTACH_AND_STAY = (
    "/usr/bin/python3 -I -S /tests/agent/_unix_client.py "
    "${GPU_HOTPLUG_AGENT_URL#unix:} POST /v1/attachments '{\"count\": 1}' /out/attach.json; "
    "exec /bin/busybox sleep 3600"
)


class NoNetworkSpawner(DockerSpawner):  # type: ignore[misc]
    _client = None  # its own Docker client, not one cached by another test's spawner class

    async def get_ip_and_port(self) -> tuple[str, int]:
        return "127.0.0.1", int(self.port)


@pytest.fixture(scope="module")
def docker_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Podman, Path]]:
    engine = Podman(tmp_path_factory.mktemp("podman-api"), runtime="runc")
    engine.prepare()
    socket_path = engine.root / "docker.sock"
    service = engine.start_service(socket_path)
    try:
        yield engine, socket_path
    finally:
        service.terminate()
        try:
            service.wait(timeout=30)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
        NoNetworkSpawner._client = None


def _exec_open(engine: Podman, container: str, device: str) -> str:
    return engine.run(
        "exec", container, "/usr/bin/python3", "-I", "-S", "-c", OPEN_GPU, device
    ).strip()


async def test_spawned_container_attaches_through_the_mounted_socket(
    docker_api: tuple[Podman, Path], agent: AgentProcess, tmp_path: Path
) -> None:
    engine, socket_path = docker_api
    out = tmp_path / "out"
    out.mkdir()
    c = Config()
    c.DockerSpawner.client_kwargs = {"base_url": f"unix://{socket_path}", "version": "1.41"}
    c.DockerSpawner.image = IMAGE
    c.DockerSpawner.cmd = ["/bin/sh", "-c", ATTACH_AND_STAY]
    c.DockerSpawner.volumes = {str(out): "/out"}
    c.DockerSpawner.read_only_volumes = {"/usr": "/usr", str(TESTS_DIR): "/tests"}
    c.DockerSpawner.network_name = "none"
    c.DockerSpawner.remove = True
    # Explicit limits: podman's default rlimits are refused by runc on this host.
    ulimits = [{"Name": n, "Soft": 1024, "Hard": 1024} for n in ("nofile", "nproc")]
    c.DockerSpawner.extra_host_config = {"ulimits": ulimits}
    configure_dockerspawner(c, socket_path=str(agent.socket_path), runtime=None)
    spawner = docker_spawner(NoNetworkSpawner, c)

    await spawner.start()
    try:
        deadline = time.monotonic() + REPLY_TIMEOUT
        while not (out / "attach.json").exists():
            assert time.monotonic() < deadline, f"no answer in the container:\n{agent.log()}"
            time.sleep(0.05)
        reply = json.loads((out / "attach.json").read_text())
        assert reply["status"] == 201, reply
        (attachment,) = json.loads(reply["body"])["attachments"]
        container = await spawner.get_object()
        assert attachment["target"] == {"pid": container["State"]["Pid"]}
        name = container["Name"].lstrip("/")
        assert _exec_open(engine, name, attachment["device"]) == "ENXIO"

        assert agent.tcp is not None
        assert agent.tcp.delete(f"/v1/attachments/{attachment['uuid']}").status == 204
        assert _exec_open(engine, name, attachment["device"]) == "ENOENT"
    finally:
        await spawner.stop()
    assert await spawner.get_object() is None
