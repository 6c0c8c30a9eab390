"""``k8s/jupyterhub/values.yaml`` merges into a hub's own values: nothing of theirs is lost,
notebook pods get what ``configure_kubespawner`` gives them, and only GPU-on-demand profiles are
placed on GPU nodes (CPU-only profiles keep the hub's own placement).

A hub's values file with its own volumes, mounts, tolerations, environment, egress rules and
profiles (one replacing the volume lists, one with option choices) is merged with ours by the
real Helm (``helm template`` of a stub chart that prints ``.Values``: Helm's own merge, lists
replaced, maps merged), as ``helm upgrade -f theirs.yaml -f ours.yaml`` would. The merged values
then go through the mapping that zero-to-jupyterhub's ``jupyterhub_config.py`` applies
(``singleuser.extraEnv`` → ``KubeSpawner.environment``, ``singleuser.storage.extraVolumes`` →
``volumes``, ... then every ``hub.extraConfig`` snippet runs with ``c``, in key order), limited
to the keys used here; a real KubeSpawner builds each profile's pod.
"""

from __future__ import annotations

import subprocess
from typing import Any, Final

import pytest
import yaml
from traitlets.config import Config

from jupyter_gpu_hotplug._structs import MAX_GPUS_ANNOTATION
from jupyter_gpu_hotplug.spawner import configure_kubespawner

from ..spawner.kube_support import env_of, notebook_container, pod_for
from .support import K8S_DIR, VALUES_FILE, by_kind, helm_or_skip, render, validate

# Helm from tests/realnode/build.sh: the real-node lane of .ci/test, which builds it first.
pytestmark = [pytest.mark.usefixtures("unreachable_kubeconfig"), pytest.mark.realnode]

EGRESS_FILE: Final = K8S_DIR / "jupyterhub" / "notebook-egress.yaml"

# singleuser.<key> → KubeSpawner.<trait>, as z2jh's jupyterhub_config.py maps them.
Z2JH_SINGLEUSER: Final = {
    ("extraEnv",): "environment",
    ("extraPodConfig",): "extra_pod_config",
    ("extraAnnotations",): "extra_annotations",
    ("nodeSelector",): "node_selector",
    ("extraTolerations",): "tolerations",
    ("storage", "extraVolumes"): "volumes",
    ("storage", "extraVolumeMounts"): "volume_mounts",
    ("profileList",): "profile_list",
}
NOT_SPAWNER: Final = {"networkPolicy"}
"""singleuser keys z2jh renders into other objects (the singleuser NetworkPolicy)."""

THEIRS: Final = """
singleuser:
  extraEnv:
    HUB_SETTING: "theirs"
  nodeSelector:
    pool: ml
  extraTolerations:
    - {key: dedicated, operator: Equal, value: jupyter, effect: NoSchedule}
  storage:
    extraVolumes:
      - {name: shared, persistentVolumeClaim: {claimName: shared-data}}
    extraVolumeMounts:
      - {name: shared, mountPath: /shared}
  networkPolicy:
    egress:
      - to: [{ipBlock: {cidr: 10.20.0.0/16}}]
        ports: [{protocol: TCP, port: 5432}]
  profileList:
    - display_name: Small
      slug: small
      default: true
    - display_name: Up to 4 GPUs on demand
      slug: gpu-large
      kubespawner_override:
        extra_annotations:
          gpu-hotplug.jupyter.org/max-gpus: "4"
        node_selector:
          nvidia.com/gpu.present: "true"
    - display_name: Own volumes
      slug: own-volumes
      kubespawner_override:
        volumes: [{name: scratch, emptyDir: {}}]
        volume_mounts: [{name: scratch, mountPath: /scratch}]
        tolerations: [{key: scratch-nodes, operator: Exists, effect: NoSchedule}]
    - display_name: With options
      slug: options
      profile_options:
        image:
          display_name: Image
          choices:
            scipy:
              display_name: SciPy
              default: true
              kubespawner_override:
                volumes: [{name: datasets, emptyDir: {}}]
                volume_mounts: [{name: datasets, mountPath: /datasets}]
hub:
  extraConfig:
    00-theirs: |
      c.KubeSpawner.start_timeout = 600
"""
THEIR_PROFILES: Final = ("small", "gpu-large", "own-volumes", "options")
PROFILES: Final = (*THEIR_PROFILES, "gpu-on-demand")
"""The hub's profiles and the one the values add."""
GPU_PROFILES: Final = frozenset({"gpu-large", "gpu-on-demand"})
"""Profiles that select GPU nodes: the hub's own (its override names the GPU-node label) and
the values' GPU-on-demand profile; the others are CPU-only."""
TOKEN: Final = "gpu-hotplug-token"
GPU_TOLERATION: Final = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GPU_NODES: Final = {"nvidia.com/gpu.present": "true"}


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``-f theirs.yaml -f k8s/jupyterhub/values.yaml``, merged by Helm itself."""
    binary = helm_or_skip()
    stub = tmp_path_factory.mktemp("stub")
    (stub / "templates").mkdir()
    (stub / "Chart.yaml").write_text("apiVersion: v2\nname: stub\nversion: 0.0.1\n")
    (stub / "templates" / "values.yaml").write_text("{{ toYaml .Values }}\n")
    theirs = stub / "theirs.yaml"
    theirs.write_text(THEIRS)
    result = subprocess.run(
        [binary, "template", "hub", str(stub), "-f", str(theirs), "-f", str(VALUES_FILE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    values = yaml.safe_load(result.stdout)
    assert isinstance(values, dict)
    return values


def _theirs() -> dict[str, Any]:
    values = yaml.safe_load(THEIRS)
    assert isinstance(values, dict)
    return values


def hub_config(values: dict[str, Any], *, runs: int = 1) -> Config:
    """The KubeSpawner configuration the chart's hub would run with these values."""
    singleuser = values["singleuser"]
    handled = {path[0] for path in Z2JH_SINGLEUSER} | NOT_SPAWNER
    assert set(singleuser) <= handled, "map the new keys here first"
    c = Config()
    for path, trait in Z2JH_SINGLEUSER.items():
        value: Any = singleuser
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            c.KubeSpawner[trait] = value
    for _ in range(runs):
        for name in sorted(values["hub"]["extraConfig"]):
            snippet = values["hub"]["extraConfig"][name]
            exec(compile(snippet, f"hub.extraConfig.{name}", "exec"), {"c": c})
    return c


def _names(entries: list[dict[str, Any]]) -> set[str]:
    return {entry["name"] for entry in entries}


def _their_lists(profile: str) -> dict[str, Any]:
    """What the hub's own values give a pod of ``profile``: volumes, mounts, tolerations."""
    singleuser = _theirs()["singleuser"]
    lists = {
        "volumes": singleuser["storage"]["extraVolumes"],
        "volume_mounts": singleuser["storage"]["extraVolumeMounts"],
        "tolerations": singleuser["extraTolerations"],
    }
    entries = [p for p in singleuser["profileList"] if p["slug"] == profile]
    overrides = [entry.get("kubespawner_override", {}) for entry in entries]
    for option in (o for entry in entries for o in entry.get("profile_options", {}).values()):
        overrides += [
            choice.get("kubespawner_override", {})
            for choice in option["choices"].values()
            if choice.get("default")
        ]
    for override in overrides:
        lists.update({key: override[key] for key in lists if key in override})
    return lists


def test_helm_keeps_every_list_of_theirs(merged: dict[str, Any]) -> None:
    theirs = _theirs()["singleuser"]
    singleuser = merged["singleuser"]
    for key in ("networkPolicy", "profileList", "extraTolerations"):
        assert singleuser[key] == theirs[key], key
    assert singleuser["storage"] == theirs["storage"]
    # Maps merge: theirs and ours side by side.
    assert singleuser["extraEnv"]["HUB_SETTING"] == "theirs"
    # No placement of ours in singleuser: it would apply to CPU-only profiles too.
    assert singleuser["nodeSelector"] == {"pool": "ml"}
    assert set(merged["hub"]["extraConfig"]) == {"00-theirs", "gpu-hotplug"}


@pytest.mark.parametrize("profile", PROFILES)
async def test_pods_keep_theirs_and_get_ours(merged: dict[str, Any], profile: str) -> None:
    pod = await pod_for(hub_config(merged), profile=profile)
    spec = pod["spec"]
    container = notebook_container(pod)
    theirs = _their_lists(profile)
    assert _names(spec["volumes"]) >= _names(theirs["volumes"]) | {TOKEN}
    assert _names(container["volumeMounts"]) >= _names(theirs["volume_mounts"]) | {TOKEN}
    for toleration in theirs["tolerations"]:
        assert toleration in spec["tolerations"]
    # GPU-on-demand profiles on GPU nodes (tolerating their taint); CPU-only ones where the
    # hub puts notebooks, without the GPU toleration. KubeSpawner merges a profile's
    # node_selector into singleuser's: the hub's pool label stays on both.
    if profile in GPU_PROFILES:
        assert spec["nodeSelector"] == {"pool": "ml", **GPU_NODES}
        assert GPU_TOLERATION in spec["tolerations"]
    else:
        assert spec["nodeSelector"] == {"pool": "ml"}
        assert GPU_TOLERATION not in spec["tolerations"]
    env = env_of(pod)
    assert env["HUB_SETTING"] == "theirs"
    assert "NVIDIA_VISIBLE_DEVICES" not in env  # CDI mode: the agent gives the driver
    # Only where the node needs it (commented out in the file): never on every notebook.
    assert spec.get("runtimeClassName") is None
    expected = "4" if profile == "gpu-large" else "1"
    assert pod["metadata"]["annotations"][MAX_GPUS_ANNOTATION] == expected


async def test_running_the_snippet_twice_changes_nothing(merged: dict[str, Any]) -> None:
    for profile in PROFILES:
        once = await pod_for(hub_config(merged), profile=profile)
        twice = await pod_for(hub_config(merged, runs=2), profile=profile)
        assert once["spec"] == twice["spec"], profile


def _comparable(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "annotations": pod["metadata"]["annotations"],
        "runtimeClassName": pod["spec"].get("runtimeClassName"),
        "volumes": sorted(pod["spec"]["volumes"], key=lambda v: v["name"]),
        "mounts": sorted(notebook_container(pod)["volumeMounts"], key=lambda m: m["name"]),
        "env": env_of(pod),
    }


async def test_a_hub_without_profiles_gets_a_cpu_default_and_gpu_on_demand(
    merged: dict[str, Any],
) -> None:
    """Without profiles of its own the hub's notebook stays what it was (CPU only, the
    default, placed by the hub) and GPU on demand is the one other choice."""
    values = {**merged, "singleuser": {**merged["singleuser"]}}
    del values["singleuser"]["profileList"]
    config = hub_config(values)
    assert [p["slug"] for p in config.KubeSpawner.profile_list] == ["cpu", "gpu-on-demand"]
    cpu = (await pod_for(config))["spec"]
    assert (cpu["nodeSelector"], GPU_TOLERATION in cpu["tolerations"]) == ({"pool": "ml"}, False)
    gpu = (await pod_for(hub_config(values), profile="gpu-on-demand"))["spec"]
    assert gpu["nodeSelector"] == {"pool": "ml", **GPU_NODES}
    assert GPU_TOLERATION in gpu["tolerations"]
    # The hub's own tolerations stay on GPU nodes too.
    assert _theirs()["singleuser"]["extraTolerations"][0] in gpu["tolerations"]


@pytest.mark.parametrize("profile", THEIR_PROFILES)
async def test_values_agree_with_the_helper(merged: dict[str, Any], profile: str) -> None:
    from_values = await pod_for(hub_config(merged), profile=profile)
    helper = hub_config(_theirs())
    configure_kubespawner(helper, max_gpus=1, runtime_class=None)
    from_helper = await pod_for(helper, profile=profile)
    assert _comparable(from_values) == _comparable(from_helper)


def test_egress_policy_reaches_the_agent() -> None:
    (policy,) = yaml.safe_load_all(EGRESS_FILE.read_text())
    validate({**policy, "metadata": {**policy["metadata"], "namespace": "jhub"}})
    objects = render()
    service = by_kind(objects, "Service", "gpu-hotplug-agent")
    namespace = by_kind(objects, "Namespace")
    labels = by_kind(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    # z2jh's notebook pods carry component=singleuser-server.
    assert policy["spec"]["podSelector"] == {"matchLabels": {"component": "singleuser-server"}}
    assert policy["spec"]["policyTypes"] == ["Egress"]
    (rule,) = policy["spec"]["egress"]
    (peer,) = rule["to"]
    # Every namespace carries kubernetes.io/metadata.name (set by the API server since 1.21).
    assert peer["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": namespace["metadata"]["name"]
    }
    assert peer["podSelector"]["matchLabels"].items() <= labels.items()
    api_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    assert rule["ports"] == [{"protocol": "TCP", "port": api_port}]


async def test_merged_pods_are_valid(merged: dict[str, Any]) -> None:
    for profile in PROFILES:
        pod = await pod_for(hub_config(merged), profile=profile)
        pod = {**pod, "apiVersion": "v1", "kind": "Pod"}
        validate(pod)
