"""What a DockerSpawner needs from the hub to build a container: a user and the hub object.

JupyterHub's own ``Hub`` is used; the user is the few attributes DockerSpawner reads (a real
``jupyterhub.user.User`` needs the hub's database).
"""

from __future__ import annotations

from typing import Any, TypeVar

from jupyterhub.objects import Hub
from traitlets.config import Config

SpawnerT = TypeVar("SpawnerT")


class HubUser:
    name = "alice"
    id = 7
    url = "/user/alice/"
    server = None
    escaped_name = "alice"
    spawners: dict[str, Any] = {}  # noqa: RUF012


def docker_spawner(cls: type[SpawnerT], config: Config) -> SpawnerT:
    """A ``cls`` (DockerSpawner or a subclass) for user ``alice`` of a default hub."""
    spawner = cls(config=config, hub=Hub(), user=HubUser())  # type: ignore[call-arg]
    spawner.api_token = "not-used"  # type: ignore[attr-defined]
    return spawner
