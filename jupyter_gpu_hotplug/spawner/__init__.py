"""JupyterHub integrations: give every single-user server what it needs to reach the node agent.

Why a package of its own: JupyterHub, KubeSpawner and DockerSpawner are heavy and belong to the
hub, not to the notebook image or the agent, so they are imported here only (the ``[hub]``
extra) and only by the helper that needs them. Use from ``jupyterhub_config.py``::

    from jupyter_gpu_hotplug.spawner import configure_kubespawner
    configure_kubespawner(c, max_gpus=2, profile_max_gpus={"gpu-large": 4})

or ``configure_dockerspawner(c, max_gpus=2)`` for a hub on one multi-GPU server
(``docs/operator-guide.md``).
"""

from __future__ import annotations

from .docker import DockerSettings, configure_dockerspawner
from .kube import configure_kubespawner
from .pieces import DEFAULT_K8S_AGENT_URL, TOKEN_DIR, TOKEN_VOLUME, PodPieces

__all__ = [
    "DEFAULT_K8S_AGENT_URL",
    "TOKEN_DIR",
    "TOKEN_VOLUME",
    "DockerSettings",
    "PodPieces",
    "configure_dockerspawner",
    "configure_kubespawner",
]
