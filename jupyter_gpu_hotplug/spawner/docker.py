"""``configure_dockerspawner``: user containers on one GPU server reach the local-mode agent.

Why it is this small: in local mode the agent identifies a caller by the kernel's peer
credentials on its unix socket and authorizes it for its own container only (by the caller's
device cgroups), so a container needs no token, only the socket. We bind the socket's
*directory*, not the socket file: a restarted agent creates a new socket inode, which a bind of
the old file would never see. That directory must hold nothing but the socket (the agent's
state and token live in its ``--state-dir``, elsewhere).

What the runtime must allow (``docs/operator-guide.md``): nothing beyond Docker's defaults. The
agent, as root on the host, writes the container's device cgroup (v1 ``devices.allow``, or the
v2 device program) and creates ``/dev/nvidiaN`` from outside, inside the container's mount
namespace; the container needs no ``--device``, no ``--privileged``. A ``--runtime nvidia``
(``runtime="nvidia"``) gives it the driver's user-space libraries and tools with
``NVIDIA_VISIBLE_DEVICES=none``. When the runtime re-applies the container's device rules
(systemd driver on ``systemctl daemon-reload``), the agent's reconciler grants the GPU again
within one ``--reconcile-interval``. GPU limits in local mode are the agent's
``--max-gpus-per-target`` (one value for every container on the host).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Final

from traitlets.config import Config

from .._structs import AGENT_URL_ENV, DEFAULT_SOCKET
from ._config import merged_dict
from .pieces import LEGACY_RUNTIME_ENV

__all__ = ["CONTAINER_SOCKET_DIR", "DockerSettings", "configure_dockerspawner"]

CONTAINER_SOCKET_DIR: Final = str(DEFAULT_SOCKET.parent)
"""Where the agent's socket directory appears in every user container."""


@dataclass(frozen=True)
class DockerSettings:
    """What ``configure_dockerspawner`` applied."""

    host_socket: str
    runtime: str | None

    def __post_init__(self) -> None:
        if not posixpath.isabs(self.host_socket) or posixpath.normpath(self.host_socket) in (
            "/",
            CONTAINER_SOCKET_DIR,
        ):
            raise ValueError(f"socket_path {self.host_socket!r} must be an absolute socket path")

    @property
    def host_dir(self) -> str:
        return posixpath.dirname(posixpath.normpath(self.host_socket))

    @property
    def container_socket(self) -> str:
        return posixpath.join(CONTAINER_SOCKET_DIR, posixpath.basename(self.host_socket))

    @property
    def volumes(self) -> dict[str, dict[str, str]]:
        return {self.host_dir: {"bind": CONTAINER_SOCKET_DIR, "mode": "rw"}}

    @property
    def environment(self) -> dict[str, str]:
        return {AGENT_URL_ENV: f"unix:{self.container_socket}", **LEGACY_RUNTIME_ENV}

    @property
    def host_config(self) -> dict[str, str]:
        return {} if self.runtime is None else {"runtime": self.runtime}


def configure_dockerspawner(
    c: Config, *, socket_path: str = str(DEFAULT_SOCKET), runtime: str | None = "nvidia"
) -> DockerSettings:
    """Configure ``c.DockerSpawner`` (its subclasses read that section too) for the local-mode
    agent listening on ``socket_path``.

    ``runtime``: the Docker runtime that mounts the NVIDIA driver's libraries (``None``: the
    image brings its own, or the default runtime does). Applying twice changes nothing.
    """
    settings = DockerSettings(host_socket=socket_path, runtime=runtime)
    section = c.DockerSpawner
    section.volumes = merged_dict(section, "volumes", settings.volumes)
    section.environment = merged_dict(section, "environment", settings.environment)
    if settings.host_config:
        section.extra_host_config = merged_dict(section, "extra_host_config", settings.host_config)
    return settings
