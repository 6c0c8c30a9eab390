"""What a notebook pod must carry to use the agent (DESIGN §7), as plain Kubernetes JSON.

Why apart from the spawner code: the same pieces are written into KubeSpawner's traits,
re-asserted on the final pod by the chained ``modify_pod_hook``, and compared with
``k8s/jupyterhub/values.yaml`` by the tests — one description, so every consumer reads the same
facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from .._structs import (
    AGENT_PORT,
    AGENT_URL_ENV,
    MAX_GPUS_ANNOTATION,
    TOKEN_AUDIENCE,
    TOKEN_PATH_ENV,
)

__all__ = [
    "DEFAULT_K8S_AGENT_URL",
    "LEGACY_RUNTIME_ENV",
    "TOKEN_DIR",
    "TOKEN_VOLUME",
    "DriverSource",
    "PodPieces",
    "check_max_gpus",
]

DEFAULT_K8S_AGENT_URL: Final = f"http://gpu-hotplug-agent.gpu-hotplug.svc:{AGENT_PORT}"
"""The Service of ``k8s/`` (``internalTrafficPolicy: Local``: always this node's agent)."""
TOKEN_VOLUME: Final = "gpu-hotplug-token"
TOKEN_DIR: Final = "/var/run/secrets/gpu-hotplug"
TOKEN_FILE: Final = "token"
LEGACY_RUNTIME_ENV: Final = {
    # NVIDIA's runtime in its legacy mode: no GPU at start, but the driver's libraries and
    # tools mounted, so a GPU attached later works without a restart. Not for CDI mode (the GPU
    # Operator's default since v25.10), where "none" names no CDI device and the agent gives
    # the libraries with the GPU (--driver-files=cdi).
    "NVIDIA_VISIBLE_DEVICES": "none",
    "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
}
DriverSource = Literal["cdi", "legacy"]
"""Where a notebook's driver libraries come from: the agent, from the node's CDI spec, at
attach (``cdi``: no runtime class, no NVIDIA variable); NVIDIA's legacy runtime at start."""
MAX_GPUS_LIMIT: Final = 64
"""A sanity bound on configured limits (more GPUs than any node has is a typo)."""


def check_max_gpus(value: object, what: str) -> int:
    """``value`` as a GPU limit; ``ValueError`` naming ``what`` unless it is an int in 0..64."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GPUS_LIMIT:
        raise ValueError(f"{what} must be an integer from 0 to {MAX_GPUS_LIMIT}, not {value!r}")
    return value


@dataclass(frozen=True)
class PodPieces:
    """The volume, mount, environment, runtime class and annotation of one configuration."""

    max_gpus: int
    agent_url: str = DEFAULT_K8S_AGENT_URL
    runtime_class: str | None = None
    token_expiration_seconds: int = 3600
    driver_source: DriverSource = "cdi"

    def __post_init__(self) -> None:
        if self.driver_source not in ("cdi", "legacy"):
            raise ValueError(f"driver_source {self.driver_source!r} is not 'cdi' or 'legacy'")
        check_max_gpus(self.max_gpus, "max_gpus")
        if not self.agent_url.startswith(("http://", "https://", "unix:")):
            raise ValueError(f"agent_url {self.agent_url!r} is not http(s):// or unix:")
        # The kubelet refuses projected tokens that live less than 10 minutes.
        if not 600 <= self.token_expiration_seconds <= 2**32:
            raise ValueError("token_expiration_seconds must be at least 600")

    @property
    def token_path(self) -> str:
        return f"{TOKEN_DIR}/{TOKEN_FILE}"

    @property
    def volume(self) -> dict[str, Any]:
        """A projected, pod-bound, short-lived token for the agent's audience only."""
        token = {
            "audience": TOKEN_AUDIENCE,
            "expirationSeconds": self.token_expiration_seconds,
            "path": TOKEN_FILE,
        }
        return {"name": TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": token}]}}

    @property
    def volume_mount(self) -> dict[str, Any]:
        return {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}

    @property
    def environment(self) -> dict[str, str]:
        return {
            AGENT_URL_ENV: self.agent_url,
            TOKEN_PATH_ENV: self.token_path,
            **(LEGACY_RUNTIME_ENV if self.driver_source == "legacy" else {}),
        }

    def annotations(self, max_gpus: int | None = None) -> dict[str, str]:
        """The limit annotation: ``max_gpus`` (a profile's) or the global one."""
        return {MAX_GPUS_ANNOTATION: str(self.max_gpus if max_gpus is None else max_gpus)}
