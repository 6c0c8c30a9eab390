"""Building a real KubeSpawner from a JupyterHub config and reading the pod it would create.

KubeSpawner's own ``_mock`` switch stands in the hub's user and hub objects (no database, no
Kubernetes API); everything else — traits, profile overrides, ``get_pod_manifest``, the
``modify_pod_hook`` — is the real code path of ``KubeSpawner.start`` up to the API call.
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubespawner import KubeSpawner
from traitlets.config import Config


async def pod_for(config: Config, *, profile: str | None = None) -> dict[str, Any]:
    """The pod (as API JSON) that ``KubeSpawner.start`` would create, after the pod hook."""
    spawner = KubeSpawner(config=config, _mock=True)
    if profile is not None:
        spawner.user_options = {"profile": profile}
    if spawner.profile_list:
        await spawner.load_user_options()
    pod = await spawner.get_pod_manifest()
    if spawner.modify_pod_hook is not None:
        pod = await spawner.modify_pod_hook(spawner, pod)
    async with ApiClient() as api:
        serialized: dict[str, Any] = api.sanitize_for_serialization(pod)
    return serialized


def notebook_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "notebook"]
    assert isinstance(container, dict)
    return container


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {variable["name"]: variable.get("value") for variable in notebook_container(pod)["env"]}
