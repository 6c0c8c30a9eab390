"""``configure_kubespawner`` against a real KubeSpawner: the pod it would create."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from traitlets.config import Config

from jupyter_gpu_hotplug._structs import (
    AGENT_URL_ENV,
    MAX_GPUS_ANNOTATION,
    TOKEN_AUDIENCE,
    TOKEN_PATH_ENV,
)
from jupyter_gpu_hotplug.spawner import DEFAULT_K8S_AGENT_URL, TOKEN_DIR, configure_kubespawner

from .kube_support import env_of, notebook_container, pod_for

pytestmark = pytest.mark.usefixtures("unreachable_kubeconfig")

K8S_VERSION = "1.31"


def _profiles() -> list[dict[str, Any]]:
    return [
        {"display_name": "Small", "slug": "small", "default": True},
        {
            "display_name": "GPU large",
            "slug": "gpu-large",
            "kubespawner_override": {"extra_annotations": {"team": "vision"}},
        },
        # A profile that replaces the list traits wholesale: the hook must restore our pieces.
        {
            "display_name": "Own volumes",
            "slug": "own-volumes",
            "kubespawner_override": {
                "volumes": [{"name": "data", "emptyDir": {}}],
                "volume_mounts": [{"name": "data", "mountPath": "/data"}],
            },
        },
    ]


def _token_volume(pod: dict[str, Any]) -> dict[str, Any]:
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "gpu-hotplug-token"]
    assert isinstance(volume, dict)
    return volume


async def test_pod_has_token_env_runtime_class_and_limit() -> None:
    c = Config()
    configure_kubespawner(c, max_gpus=2)
    pod = await pod_for(c)
    (source,) = _token_volume(pod)["projected"]["sources"]
    assert source["serviceAccountToken"] == {
        "audience": TOKEN_AUDIENCE,
        "expirationSeconds": 3600,
        "path": "token",
    }
    mounts = [
        m for m in notebook_container(pod)["volumeMounts"] if m["name"] == "gpu-hotplug-token"
    ]
    assert mounts == [{"name": "gpu-hotplug-token", "mountPath": TOKEN_DIR, "readOnly": True}]
    env = env_of(pod)
    assert env[AGENT_URL_ENV] == DEFAULT_K8S_AGENT_URL
    assert env[TOKEN_PATH_ENV] == f"{TOKEN_DIR}/token"
    # CDI mode (issue 33): the agent gives the driver's libraries with the GPU; nothing of
    # NVIDIA's runtime on the notebook (under its CDI mode "none" would keep the pod from
    # starting).
    assert not any(name.startswith("NVIDIA_") for name in env)
    assert "runtimeClassName" not in pod["spec"]
    assert pod["metadata"]["annotations"][MAX_GPUS_ANNOTATION] == "2"
    # The Kubernetes API would accept it.
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


async def test_the_legacy_runtime_mode_gives_notebooks_the_driver_at_start() -> None:
    c = Config()
    configure_kubespawner(c, max_gpus=1, driver_source="legacy", runtime_class="nvidia")
    pod = await pod_for(c)
    env = env_of(pod)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "none"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert pod["spec"]["runtimeClassName"] == "nvidia"
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


async def test_per_profile_limits() -> None:
    c = Config()
    c.KubeSpawner.profile_list = _profiles()
    configure_kubespawner(c, max_gpus=1, profile_max_gpus={"gpu-large": 4, "Own volumes": 0})
    small = await pod_for(c, profile="small")
    large = await pod_for(c, profile="gpu-large")
    own = await pod_for(c, profile="own-volumes")
    assert small["metadata"]["annotations"][MAX_GPUS_ANNOTATION] == "1"
    assert large["metadata"]["annotations"][MAX_GPUS_ANNOTATION] == "4"
    assert large["metadata"]["annotations"]["team"] == "vision"
    assert own["metadata"]["annotations"][MAX_GPUS_ANNOTATION] == "0"
    # The override replaced the volumes; the hook put the token back next to them.
    assert {v["name"] for v in own["spec"]["volumes"]} == {"data", "gpu-hotplug-token"}
    mounts = {m["name"] for m in notebook_container(own)["volumeMounts"]}
    assert mounts == {"data", "gpu-hotplug-token"}
    # Spawners share the configuration: one user's profile must not leak into another's pod.
    assert (await pod_for(c, profile="small"))["metadata"]["annotations"][
        MAX_GPUS_ANNOTATION
    ] == "1"


async def test_callable_profile_list_gets_limits() -> None:
    async def profiles(spawner: Any) -> list[dict[str, Any]]:
        return _profiles()

    c = Config()
    c.KubeSpawner.profile_list = profiles
    configure_kubespawner(c, max_gpus=1, profile_max_gpus={"gpu-large": 3})
    large = await pod_for(c, profile="gpu-large")
    assert large["metadata"]["annotations"][MAX_GPUS_ANNOTATION] == "3"


async def test_existing_hook_is_chained_and_runs_first() -> None:
    seen: list[str] = []

    async def operator_hook(spawner: Any, pod: Any) -> Any:
        seen.append(spawner.pod_name)
        pod.metadata.labels["cost-center"] = "ml"
        return pod

    c = Config()
    c.KubeSpawner.modify_pod_hook = operator_hook
    configure_kubespawner(c)
    configure_kubespawner(c)  # re-applied: still one call of the operator's hook
    pod = await pod_for(c)
    assert len(seen) == 1
    assert pod["metadata"]["labels"]["cost-center"] == "ml"
    assert pod["metadata"]["annotations"][MAX_GPUS_ANNOTATION] == "1"  # ours, after theirs


async def test_sync_hook_is_chained() -> None:
    def operator_hook(spawner: Any, pod: Any) -> Any:
        pod.spec.priority_class_name = "notebooks"
        return pod

    c = Config()
    c.KubeSpawner.modify_pod_hook = operator_hook
    configure_kubespawner(c)
    assert (await pod_for(c))["spec"]["priorityClassName"] == "notebooks"


async def test_applying_twice_changes_nothing() -> None:
    c = Config()
    c.KubeSpawner.volumes = [{"name": "home", "emptyDir": {}}]
    c.KubeSpawner.environment = {"TEAM": "vision"}
    c.KubeSpawner.profile_list = _profiles()
    configure_kubespawner(c, max_gpus=2, profile_max_gpus={"gpu-large": 4})
    once = copy.deepcopy(c)
    pods_once = [await pod_for(c, profile=p) for p in ("small", "gpu-large", "own-volumes")]
    configure_kubespawner(c, max_gpus=2, profile_max_gpus={"gpu-large": 4})
    for name in ("volumes", "volume_mounts", "environment", "extra_annotations", "profile_list"):
        assert c.KubeSpawner[name] == once.KubeSpawner[name], name
    assert c.KubeSpawner.modify_pod_hook.inner is None
    pods_twice = [await pod_for(c, profile=p) for p in ("small", "gpu-large", "own-volumes")]
    assert pods_twice == pods_once
    assert [v["name"] for v in pods_once[0]["spec"]["volumes"]].count("gpu-hotplug-token") == 1
    assert env_of(pods_once[0])["TEAM"] == "vision"


async def test_reapplying_with_new_values_replaces_ours() -> None:
    c = Config()
    configure_kubespawner(c, max_gpus=2)
    configure_kubespawner(c, max_gpus=5, agent_url="https://agent.example:8477", runtime_class=None)
    pod = await pod_for(c)
    assert pod["metadata"]["annotations"][MAX_GPUS_ANNOTATION] == "5"
    assert env_of(pod)[AGENT_URL_ENV] == "https://agent.example:8477"


def test_dict_volumes_form_is_kept() -> None:
    c = Config()
    c.KubeSpawner.volumes = {"home": {"name": "home", "emptyDir": {}}}
    configure_kubespawner(c)
    assert set(c.KubeSpawner.volumes) == {"home", "gpu-hotplug-token"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_gpus": -1}, "max_gpus"),
        ({"max_gpus": True}, "max_gpus"),
        ({"max_gpus": 1000}, "max_gpus"),
        ({"agent_url": "agent:8477"}, "agent_url"),
        ({"token_expiration_seconds": 60}, "token_expiration_seconds"),
        ({"profile_max_gpus": {"nope": 1}}, "nope"),
        ({"profile_max_gpus": {"small": "2"}}, "small"),
    ],
)
def test_bad_arguments_are_refused_and_change_nothing(kwargs: dict[str, Any], message: str) -> None:
    c = Config()
    c.KubeSpawner.profile_list = _profiles()
    before = copy.deepcopy(c)
    with pytest.raises(ValueError, match=message):
        configure_kubespawner(c, **kwargs)
    assert c == before


def test_refusal_on_an_empty_config_leaves_it_empty() -> None:
    c = Config()
    with pytest.raises(ValueError, match="profile_max_gpus"):
        configure_kubespawner(c, profile_max_gpus={"gpu-large": 2})
    assert c == Config()
