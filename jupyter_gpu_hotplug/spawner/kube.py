"""``configure_kubespawner``: KubeSpawner's notebook pods get the token, environment, runtime
class and GPU limit the agent needs (DESIGN §7).

Why traits *and* a hook: the traits (``volumes``, ``environment``, ``extra_annotations``...) are
what operators read and what zero-to-jupyterhub's values map to, so the configuration stays
inspectable. But a profile's ``kubespawner_override`` *replaces* list traits such as ``volumes``,
which would silently drop the token; the chained ``modify_pod_hook`` therefore re-asserts the
pieces on the final pod, after the operator's own hook has run. Re-applying replaces our settings
and our hook wrapper instead of stacking a second one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from traitlets.config import Config

from .._structs import MAX_GPUS_ANNOTATION
from ._config import current, merged_dict, with_named
from .pieces import DEFAULT_K8S_AGENT_URL, TOKEN_VOLUME, DriverSource, PodPieces, check_max_gpus

__all__ = ["PodHook", "configure_kubespawner"]

NOTEBOOK_CONTAINER: Final = "notebook"
"""KubeSpawner's name for the single-user server's container."""

PodHookFunction = Callable[[Any, Any], Any]


def configure_kubespawner(
    c: Config,
    *,
    max_gpus: int = 1,
    agent_url: str = DEFAULT_K8S_AGENT_URL,
    runtime_class: str | None = None,
    token_expiration_seconds: int = 3600,
    profile_max_gpus: Mapping[str, int] | None = None,
    driver_source: DriverSource = "cdi",
) -> PodPieces:
    """Configure ``c.KubeSpawner`` for jupyter-gpu-hotplug; returns what was applied.

    ``max_gpus``: the GPUs one server may hot-attach (the pod annotation the agent enforces);
    ``profile_max_gpus``: per ``profile_list`` entry (by slug or display name), overriding it —
    call this after ``profile_list`` is set. ``driver_source``: ``cdi`` (the default; the GPU
    Operator's since v25.10) — the agent gives the driver's libraries with the GPU, notebooks
    need no runtime class and no NVIDIA variable; ``legacy`` — NVIDIA's runtime in legacy mode
    gives them at start (``NVIDIA_VISIBLE_DEVICES=none``), with ``runtime_class`` (``nvidia``)
    where it is not the node's default. Raises ``ValueError`` for a bad limit or an unknown
    profile.
    """
    pieces = PodPieces(
        max_gpus=max_gpus,
        agent_url=agent_url,
        runtime_class=runtime_class,
        token_expiration_seconds=token_expiration_seconds,
        driver_source=driver_source,
    )
    limits = {
        name: check_max_gpus(value, f"profile_max_gpus[{name!r}]")
        for name, value in (profile_max_gpus or {}).items()
    }
    # Everything is computed before anything is written: a refusal leaves ``c`` as it was
    # (reading ``c.KubeSpawner`` would already add an empty section).
    section = c["KubeSpawner"] if "KubeSpawner" in c else Config()
    values: dict[str, Any] = {
        "volumes": with_named(section, "volumes", pieces.volume),
        "volume_mounts": with_named(section, "volume_mounts", pieces.volume_mount),
        "environment": merged_dict(section, "environment", pieces.environment),
        "extra_annotations": merged_dict(section, "extra_annotations", pieces.annotations()),
    }
    if runtime_class is not None:
        extra = {"runtimeClassName": runtime_class}
        values["extra_pod_config"] = merged_dict(section, "extra_pod_config", extra)
    profiles = current(section, "profile_list", [])
    if limits or profiles:
        values["profile_list"] = _profiles_with_limits(profiles, limits)
    hook = current(section, "modify_pod_hook", None)
    values["modify_pod_hook"] = PodHook(
        pieces, inner=hook.inner if isinstance(hook, PodHook) else hook
    )
    for name, value in values.items():
        c.KubeSpawner[name] = value
    return pieces


def _profiles_with_limits(profiles: Any, limits: Mapping[str, int]) -> Any:
    if isinstance(profiles, _ProfilesWithLimits):
        return _ProfilesWithLimits(profiles.inner, limits)
    if callable(profiles):
        return _ProfilesWithLimits(profiles, limits)
    entries = list(profiles.values()) if isinstance(profiles, Mapping) else profiles
    unknown = set(limits) - {name for entry in entries for name in _profile_names(entry)}
    if unknown:
        raise ValueError(f"profile_max_gpus names profiles not in profile_list: {sorted(unknown)}")
    if isinstance(profiles, Mapping):
        return {key: _profile_with_limit(entry, limits) for key, entry in profiles.items()}
    return [_profile_with_limit(entry, limits) for entry in profiles]


def _profile_names(entry: Mapping[str, Any]) -> Iterable[str]:
    return [str(entry[key]) for key in ("slug", "display_name") if key in entry]


def _profile_with_limit(entry: Mapping[str, Any], limits: Mapping[str, int]) -> dict[str, Any]:
    """The entry with its own annotation (KubeSpawner merges override dicts into the trait)."""
    limit = next((limits[name] for name in _profile_names(entry) if name in limits), None)
    if limit is None:
        return dict(entry)
    override = dict(entry.get("kubespawner_override", {}))
    override["extra_annotations"] = {
        **override.get("extra_annotations", {}),
        MAX_GPUS_ANNOTATION: str(limit),
    }
    return {**entry, "kubespawner_override": override}


class _ProfilesWithLimits:
    """A callable ``profile_list`` whose answers get the per-profile limits."""

    def __init__(self, inner: Callable[[Any], Any], limits: Mapping[str, int]) -> None:
        self.inner = inner
        self.limits = dict(limits)

    async def __call__(self, spawner: Any) -> Any:
        profiles = self.inner(spawner)
        if inspect.isawaitable(profiles):
            profiles = await profiles
        return _profiles_with_limits(profiles, self.limits)


class PodHook:
    """The ``modify_pod_hook``: the operator's hook first, then ours makes sure the pod still
    carries the token volume and mount, the environment, the runtime class and a limit.

    What is already on the pod wins (a profile's own limit or agent URL); only what is missing
    is added, so a pod passing through twice is unchanged.
    """

    def __init__(self, pieces: PodPieces, *, inner: PodHookFunction | None) -> None:
        self.pieces = pieces
        self.inner = inner

    async def __call__(self, spawner: Any, pod: Any) -> Any:
        if self.inner is not None:
            pod = self.inner(spawner, pod)
            if inspect.isawaitable(pod):
                pod = await pod
        self.ensure(pod)
        return pod

    def ensure(self, pod: Any) -> None:
        """Add the missing pieces to a KubeSpawner pod (``kubernetes_asyncio`` models)."""
        # Imported here: a DockerSpawner hub need not install KubeSpawner.
        from kubernetes_asyncio.client.models import V1EnvVar, V1Volume, V1VolumeMount
        from kubespawner.utils import get_k8s_model

        spec = pod.spec
        spec.volumes = spec.volumes or []
        if not any(volume.name == TOKEN_VOLUME for volume in spec.volumes):
            spec.volumes.append(get_k8s_model(V1Volume, self.pieces.volume))
        container = next(
            (c for c in spec.containers if c.name == NOTEBOOK_CONTAINER), spec.containers[0]
        )
        container.volume_mounts = container.volume_mounts or []
        if not any(mount.name == TOKEN_VOLUME for mount in container.volume_mounts):
            mount = get_k8s_model(V1VolumeMount, self.pieces.volume_mount)
            container.volume_mounts.append(mount)
        container.env = container.env or []
        present = {variable.name for variable in container.env}
        for name, value in self.pieces.environment.items():
            if name not in present:
                container.env.append(V1EnvVar(name=name, value=value))
        if spec.runtime_class_name is None and self.pieces.runtime_class is not None:
            spec.runtime_class_name = self.pieces.runtime_class
        metadata = pod.metadata
        metadata.annotations = metadata.annotations or {}
        for name, value in self.pieces.annotations().items():
            metadata.annotations.setdefault(name, value)
