"""``k8s/jupyterhub/values.yaml`` gives notebook pods what ``configure_kubespawner`` gives them.

The values go through the same mapping that zero-to-jupyterhub's ``jupyterhub_config.py`` applies
(``singleuser.extraEnv`` → ``KubeSpawner.environment``, ``singleuser.storage.extraVolumes`` →
``volumes``, ... then every ``hub.extraConfig`` snippet runs with ``c``), limited to the keys
the file uses; a real KubeSpawner then builds the pods, which are compared with the helper's for
every profile. The chart's singleuser NetworkPolicy, with the file's egress rule appended, is
validated and checked to reach the agent of ``k8s/``.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from traitlets.config import Config

from jupyter_gpu_hotplug._structs import MAX_GPUS_ANNOTATION
from jupyter_gpu_hotplug.spawner import configure_kubespawner

from ..spawner.kube_support import env_of, notebook_container, pod_for
from .support import VALUES_FILE, by_kind, render, validate

pytestmark = pytest.mark.usefixtures("unreachable_kubeconfig")

# singleuser.<key> → KubeSpawner.<trait>, as z2jh's jupyterhub_config.py maps them.
Z2JH_SINGLEUSER = {
    ("extraEnv",): "environment",
    ("extraPodConfig",): "extra_pod_config",
    ("extraAnnotations",): "extra_annotations",
    ("storage", "extraVolumes"): "volumes",
    ("storage", "extraVolumeMounts"): "volume_mounts",
    ("profileList",): "profile_list",
}
HANDLED = {"extraEnv", "extraPodConfig", "extraAnnotations", "storage", "profileList"}


def _values() -> dict[str, Any]:
    values = yaml.safe_load(VALUES_FILE.read_text())
    assert isinstance(values, dict)
    return values


def hub_config(values: dict[str, Any]) -> Config:
    """The KubeSpawner configuration the chart's hub would run with these values."""
    singleuser = values["singleuser"]
    assert set(singleuser) - {"networkPolicy"} == HANDLED, "map the new keys here first"
    c = Config()
    for path, trait in Z2JH_SINGLEUSER.items():
        value: Any = singleuser
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            c.KubeSpawner[trait] = value
    for snippet in values["hub"]["extraConfig"].values():
        exec(compile(snippet, "hub.extraConfig", "exec"), {"c": c})
    return c


def _comparable(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "annotations": pod["metadata"]["annotations"],
        "runtimeClassName": pod["spec"].get("runtimeClassName"),
        "volumes": sorted(pod["spec"]["volumes"], key=lambda v: v["name"]),
        "mounts": sorted(notebook_container(pod)["volumeMounts"], key=lambda m: m["name"]),
        "env": env_of(pod),
    }


@pytest.mark.parametrize("profile", ["small", "gpu-large", "own-volumes"])
async def test_values_agree_with_the_helper(profile: str) -> None:
    values = _values()
    # An operator's own profile that replaces the volume lists, added to the file's profiles.
    own = {
        "display_name": "Own volumes",
        "slug": "own-volumes",
        "kubespawner_override": {
            "volumes": [{"name": "data", "emptyDir": {}}],
            "volume_mounts": [{"name": "data", "mountPath": "/data"}],
        },
    }
    values["singleuser"]["profileList"].append(own)
    from_values = await pod_for(hub_config(values), profile=profile)

    helper = Config()
    helper.KubeSpawner.profile_list = [
        {k: v for k, v in p.items() if k != "kubespawner_override"}
        if p["slug"] != "own-volumes"
        else p
        for p in values["singleuser"]["profileList"]
    ]
    configure_kubespawner(helper, max_gpus=1, profile_max_gpus={"gpu-large": 4})
    from_helper = await pod_for(helper, profile=profile)

    assert _comparable(from_values) == _comparable(from_helper)
    expected = {"small": "1", "gpu-large": "4", "own-volumes": "1"}[profile]
    assert from_values["metadata"]["annotations"][MAX_GPUS_ANNOTATION] == expected


def test_egress_rule_reaches_the_agent() -> None:
    (rule,) = _values()["singleuser"]["networkPolicy"]["egress"]
    objects = render()
    service = by_kind(objects, "Service", "gpu-hotplug-agent")
    namespace = by_kind(objects, "Namespace")
    labels = by_kind(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    (peer,) = rule["to"]
    # Every namespace carries kubernetes.io/metadata.name (set by the API server since 1.21).
    assert peer["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": namespace["metadata"]["name"]
    }
    assert peer["podSelector"]["matchLabels"].items() <= labels.items()
    assert rule["ports"] == [{"protocol": "TCP", "port": service["spec"]["ports"][0]["port"]}]
    # The chart's singleuser NetworkPolicy with this rule appended is a valid object.
    validate(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "singleuser", "namespace": "jhub"},
            "spec": {
                "podSelector": {"matchLabels": {"component": "singleuser-server"}},
                "policyTypes": ["Ingress", "Egress"],
                "egress": [rule],
            },
        }
    )


def test_values_volumes_are_valid_pod_parts() -> None:
    singleuser = _values()["singleuser"]
    validate(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "n", "annotations": singleuser["extraAnnotations"]},
            "spec": {
                **singleuser["extraPodConfig"],
                "volumes": singleuser["storage"]["extraVolumes"],
                "containers": [
                    {
                        "name": "notebook",
                        "image": "quay.io/jupyter/base-notebook",
                        "env": [{"name": k, "value": v} for k, v in singleuser["extraEnv"].items()],
                        "volumeMounts": singleuser["storage"]["extraVolumeMounts"],
                    }
                ],
            },
        }
    )
