"""The real node's hub (``tests/realnode/hub_config/jupyterhub_config.py`` over the tier's values
and ``k8s/jupyterhub/values.yaml``) builds the notebook pods a platform team's hub would: a real
KubeSpawner (``_mock``) renders each profile's pod from the configuration as the hub loads it.

Why here and not only on the node: the hub tier takes minutes to come up; what its configuration
gives a pod — each of our pieces once, though both the values' snippet and
``configure_kubespawner`` ran, the default "CPU only" profile and the GPU-on-demand one — is
checked in the fast run, so a change to the values or the helper that breaks the tier fails
here first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Final

import pytest
import yaml
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

from jupyter_gpu_hotplug._structs import IDLE_RELEASE_ANNOTATION, MAX_GPUS_ANNOTATION
from jupyter_gpu_hotplug.spawner import DEFAULT_K8S_AGENT_URL, TOKEN_VOLUME

from ..realnode.hub import CONFIG, IDLE_PROFILE, IDLE_SECONDS, MAX_GPUS, PRODUCT_VALUES, tier_values
from ..spawner.kube_support import env_of, notebook_container, pod_for

pytestmark = pytest.mark.usefixtures("unreachable_kubeconfig")

IMAGE: Final = "localhost/jupyter-gpu-hotplug-notebook:1.2.3"
AGENT_IP: Final = "10.96.0.77"


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    """The hub's configuration, loaded as ``jupyterhub -f`` loads it, in the hub pod's
    environment (the Services' variables, the Secret's values)."""
    nvml_config = tmp_path / "nvml.conf"
    tier = tmp_path / "tier-values.yaml"
    tier.write_text(yaml.safe_dump(tier_values(IMAGE, nvml_config, AGENT_IP)))
    environ = {
        "HUB_VALUES": f"{tier}:{PRODUCT_VALUES}",
        "HUB_SERVICE_HOST": "10.96.0.10", "HUB_SERVICE_PORT": "8081",
        "PROXY_API_SERVICE_HOST": "10.96.0.11", "PROXY_API_SERVICE_PORT": "8001",
        "POD_NAMESPACE": "jhub", "HUB_USER_PASSWORD": "pw", "JUPYTERHUB_TIER_TOKEN": "t" * 32,
    }  # fmt: skip
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    loaded: Config = PyFileConfigLoader(CONFIG.name, path=str(CONFIG.parent)).load_config()
    return loaded


def pod(config: Config, profile: str | None = None) -> dict[str, Any]:
    return asyncio.run(pod_for(config, profile=profile))


def test_the_default_profile_is_cpu_only_with_each_of_our_pieces_once(config: Config) -> None:
    spec = pod(config)["spec"]
    assert [v["name"] for v in spec["volumes"]].count(TOKEN_VOLUME) == 1
    container = notebook_container({"spec": spec})
    assert [m["name"] for m in container["volumeMounts"]].count(TOKEN_VOLUME) == 1
    assert container["image"] == IMAGE and container["imagePullPolicy"] == "Never"
    env = env_of({"spec": spec})
    assert env["GPU_HOTPLUG_AGENT_URL"] == DEFAULT_K8S_AGENT_URL
    assert not any(name.startswith("NVIDIA_") for name in env)
    assert not spec.get("nodeSelector") and not spec.get("runtimeClassName")
    (alias,) = spec["hostAliases"]
    assert alias == {"ip": AGENT_IP, "hostnames": ["gpu-hotplug-agent.gpu-hotplug.svc"]}


def test_the_gpu_on_demand_profile_is_placed_on_gpu_nodes(config: Config) -> None:
    spec = pod(config, "gpu-on-demand")["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert [v["name"] for v in spec["volumes"]].count(TOKEN_VOLUME) == 1


def test_the_servers_limit_is_the_hubs(config: Config) -> None:
    assert pod(config)["metadata"]["annotations"][MAX_GPUS_ANNOTATION] == str(MAX_GPUS)


def test_the_hubs_own_profiles_stay_and_the_short_idle_one_keeps_our_pieces(
    config: Config,
) -> None:
    slugs = [p["slug"] for p in config.KubeSpawner.profile_list]
    assert slugs == ["cpu", IDLE_PROFILE, "gpu-on-demand"]
    built = pod(config, IDLE_PROFILE)
    annotations = built["metadata"]["annotations"]
    # KubeSpawner merges the override's annotations into the hub's: the limit stays.
    assert annotations[IDLE_RELEASE_ANNOTATION] == str(IDLE_SECONDS)
    assert annotations[MAX_GPUS_ANNOTATION] == str(MAX_GPUS)
    assert [v["name"] for v in built["spec"]["volumes"]].count(TOKEN_VOLUME) == 1
    assert IDLE_RELEASE_ANNOTATION not in pod(config)["metadata"]["annotations"]


def test_the_tier_client_may_start_stop_and_reach_servers_only(config: Config) -> None:
    (service,) = config.JupyterHub.services
    (role,) = config.JupyterHub.load_roles
    assert service["name"] == "tier" and role["services"] == ["tier"]
    assert set(role["scopes"]) == {"admin:users", "admin:servers", "access:servers", "read:users"}
    assert config.Authenticator.allowed_users == {"alice", "bob"}
