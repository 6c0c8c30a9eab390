"""``configure_dockerspawner`` against a real DockerSpawner: the container it would create.

DockerSpawner's ``create_object`` runs for real, down to the Docker API call, which is captured
(no Docker daemon here; ``tests/local_runtimes`` runs such a container under podman instead).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest
from dockerspawner import DockerSpawner
from traitlets.config import Config

from jupyter_gpu_hotplug._structs import AGENT_URL_ENV
from jupyter_gpu_hotplug.spawner import configure_dockerspawner

from .docker_support import docker_spawner


class CapturingSpawner(DockerSpawner):  # type: ignore[misc]
    """Records the Docker API calls instead of making them."""

    calls: list[tuple[str, dict[str, Any]]]

    async def docker(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((method, kwargs))
        return {"Id": "0" * 64}


async def create_kwargs(config: Config) -> dict[str, Any]:
    # A pinned API version: the client is built without asking a daemon for its version.
    config.DockerSpawner.cmd = ["jupyterhub-singleuser"]
    config.DockerSpawner.client_kwargs = {"version": "1.41", "base_url": "unix:///nonexistent"}
    spawner = docker_spawner(CapturingSpawner, config)
    spawner.calls = []
    await spawner.create_object()
    ((method, kwargs),) = spawner.calls
    assert method == "create_container"
    return kwargs


async def test_container_gets_socket_env_and_runtime() -> None:
    c = Config()
    c.DockerSpawner.volumes = {"jupyterhub-user-{username}": "/home/jovyan/work"}
    configure_dockerspawner(c)
    kwargs = await create_kwargs(c)
    binds = kwargs["host_config"]["Binds"]
    assert "/run/gpu-hotplug:/run/gpu-hotplug:rw" in binds
    assert "jupyterhub-user-alice:/home/jovyan/work:rw" in binds
    assert kwargs["host_config"]["Runtime"] == "nvidia"
    environment = kwargs["environment"]
    assert environment[AGENT_URL_ENV] == "unix:/run/gpu-hotplug/agent.sock"
    assert environment["NVIDIA_VISIBLE_DEVICES"] == "none"
    assert environment["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    # Identity comes from the socket's peer credentials: no token, no privilege, no devices.
    assert "GPU_HOTPLUG_TOKEN_PATH" not in environment
    assert not kwargs["host_config"].get("Privileged")
    assert not kwargs["host_config"].get("Devices")


async def test_custom_socket_path_and_no_runtime() -> None:
    c = Config()
    configure_dockerspawner(c, socket_path="/srv/gpu/api.sock", runtime=None)
    kwargs = await create_kwargs(c)
    assert "/srv/gpu:/run/gpu-hotplug:rw" in kwargs["host_config"]["Binds"]
    assert kwargs["environment"][AGENT_URL_ENV] == "unix:/run/gpu-hotplug/api.sock"
    assert "Runtime" not in kwargs["host_config"]


def test_applying_twice_changes_nothing() -> None:
    c = Config()
    c.DockerSpawner.environment = {"TEAM": "vision"}
    configure_dockerspawner(c)
    once = copy.deepcopy(c)
    configure_dockerspawner(c)
    assert c == once
    assert c.DockerSpawner.environment["TEAM"] == "vision"


@pytest.mark.parametrize("path", ["relative.sock", "/", "/run/gpu-hotplug"])
def test_bad_socket_path_is_refused(path: str) -> None:
    c = Config()
    with pytest.raises(ValueError, match="socket_path"):
        configure_dockerspawner(c, socket_path=path)
    assert c == Config()


def test_a_docker_hub_needs_no_kubespawner() -> None:
    # The [hub] extra brings both spawners, but a hub with DockerSpawner only may lack the other.
    code = (
        "import sys\n"
        "sys.modules['kubespawner'] = sys.modules['kubernetes_asyncio'] = None\n"
        "from traitlets.config import Config\n"
        "from jupyter_gpu_hotplug.spawner import configure_dockerspawner\n"
        "configure_dockerspawner(Config())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
