"""The real node in ``cdi`` mode, as the GPU Operator >= 25.10 sets a node up.

What issue 33's attach has to match: on such a node a pod that asks for ``nvidia.com/gpu`` runs
under plain runc (no RuntimeClass) and still gets its GPU — ``/dev/nvidia<N>``, the driver's
libraries and ``nvidia-smi`` — because NVIDIA's plugin answers with CDI device names
(``cdi-annotations,cdi-cri``) and containerd applies the spec's ``containerEdits``, hooks
included. All of it is NVIDIA's and containerd's own code over the simulated driver; the node
runs for this module only (``cdi_cluster``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

import pytest

from jupyter_gpu_hotplug.nvml.sim import CUDA_LIBRARY_NAME, LIBRARY_NAME
from jupyter_gpu_hotplug.nvml.sim.driver_root import LIBRARY_DIR, SMI_PATH, versioned_name
from jupyter_gpu_hotplug.nvml.sim.smi import BANNER

from ..fixtures.requirements import needs_root
from .cluster import Cluster
from .node import (
    CDI_DEVICE_LIST_STRATEGY,
    GPU_RESOURCE,
    NVIDIA_RUNTIME,
    PLUGIN_REGISTERED,
    RUNTIME_CLASSES,
)

PLUGIN_SPEC: Final = "k8s.device-plugin.nvidia.com-gpu.json"
"""The spec NVIDIA's plugin writes for the devices it serves (``/var/run/cdi`` in its view)."""
DRIVER_FILES: Final = (
    f"/{LIBRARY_DIR}/{versioned_name(CUDA_LIBRARY_NAME)}",
    f"/{LIBRARY_DIR}/{versioned_name(LIBRARY_NAME)}",
    f"/{SMI_PATH}",
)
"""What the spec mounts from the driver root, where a container sees it."""

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]


def mounts(cluster: Cluster, namespace: str, pod: str) -> dict[str, str]:
    """The container's bind mounts: mount point → the host path it shows."""
    result = cluster.exec(namespace, pod, ["cat", "/proc/self/mountinfo"])
    assert result.exit_code == 0, result.stderr
    found = {}
    for line in result.stdout.splitlines():
        fields = line.split()
        found[fields[4]] = fields[3]
    return found


def gpu_pod(cluster: Cluster, namespace: str, name: str, runtime_class: str | None = None) -> int:
    """A Running pod with one ``nvidia.com/gpu``; the minor of the GPU PodResources names."""
    limits = {"limits": {GPU_RESOURCE: "1"}}
    cluster.run_notebook_pod(namespace, name, resources=limits, runtime_class=runtime_class)
    (uuid,) = cluster.podresources_get(namespace, name)
    config = cluster.node.nvml_config
    assert config is not None
    return next(gpu.minor for gpu in config.gpus if gpu.uuid == uuid)


def test_the_node_is_set_up_as_the_gpu_operator_sets_it_up(cdi_cluster: Cluster) -> None:
    node = cdi_cluster.node
    assert node.mode == "cdi"
    classes = node.kubectl_json("get", "runtimeclasses")["items"]
    assert {(c["metadata"]["name"], c["handler"]) for c in classes} == {
        (name, name) for name in RUNTIME_CLASSES
    }
    plugin_log = node.log_tail("nvidia-device-plugin", 10**6)
    assert PLUGIN_REGISTERED in plugin_log
    for strategy in CDI_DEVICE_LIST_STRATEGY.split(","):  # in the config it prints
        assert f'"{strategy}"' in plugin_log
    assert node.cdi_spec is not None and node.cdi_spec.path.parent == node.cdi_spec_dir
    plugin_spec = json.loads((node.cdi_spec_dir / PLUGIN_SPEC).read_text())
    config = node.nvml_config
    assert config is not None
    whole = {gpu.uuid for gpu in config.gpus if not gpu.mig_devices}
    assert whole <= {d["name"] for d in plugin_spec["devices"]}, "named by UUID"
    config_text = (node.containerd_dir / "config.toml").read_text()
    assert 'default_runtime_name = "runc"' in config_text, "NVIDIA's runtime is not the default"
    assert f"runtimes.{NVIDIA_RUNTIME}]" in config_text


def test_a_gpu_pod_under_runc_gets_its_device_and_the_driver_through_cdi(
    cdi_cluster: Cluster,
) -> None:
    namespace = cdi_cluster.namespace("cdi")
    minor = gpu_pod(cdi_cluster, namespace, "runc")
    assert not cdi_cluster.pod(namespace, "runc")["spec"].get("runtimeClassName")

    listing = cdi_cluster.exec(namespace, "runc", ["ls", "/dev"]).stdout.split()
    assert sorted(n for n in listing if n.startswith("nvidia")) == [f"nvidia{minor}", "nvidiactl"]
    opened = cdi_cluster.open_device(namespace, "runc", minor)
    assert "No such device or address" in opened, "allowed by the device cgroup (ENXIO)"

    driver_root = cdi_cluster.node.driver_root
    shown = mounts(cdi_cluster, namespace, "runc")
    for inside in DRIVER_FILES:
        assert shown.get(inside) == str(driver_root / inside.lstrip("/")), inside

    # The spec's hooks ran in the container: create-symlinks and update-ldcache.
    libdir = f"/{LIBRARY_DIR}"
    links = cdi_cluster.exec(namespace, "runc", ["ls", "-l", libdir]).stdout
    assert f"{CUDA_LIBRARY_NAME} -> {versioned_name(CUDA_LIBRARY_NAME)}" in links
    assert f"{LIBRARY_NAME} -> {versioned_name(LIBRARY_NAME)}" in links
    cache = cdi_cluster.exec(namespace, "runc", ["cat", "/etc/ld.so.cache"]).stdout
    assert CUDA_LIBRARY_NAME in cache
    environ = cdi_cluster.exec(namespace, "runc", ["env"]).stdout.splitlines()
    assert "NVIDIA_VISIBLE_DEVICES=void" in environ
    # The mounted nvidia-smi runs with the container's own /bin/sh; this busybox image has
    # no python3 for the simulated one, and it says so as a missing command would.
    smi = cdi_cluster.exec(namespace, "runc", [f"/{SMI_PATH}", "-L"])
    assert (smi.exit_code, BANNER in smi.stderr) == (127, True), smi


def test_the_nvidia_runtime_class_gives_the_same_gpu(cdi_cluster: Cluster) -> None:
    """Workloads that still name ``runtimeClassName: nvidia`` keep working: NVIDIA's runtime
    in ``cdi`` mode over runc."""
    namespace = cdi_cluster.namespace("cdi")
    minor = gpu_pod(cdi_cluster, namespace, "nvidia", runtime_class=NVIDIA_RUNTIME)
    opened = cdi_cluster.open_device(namespace, "nvidia", minor)
    assert "No such device or address" in opened
    shown = mounts(cdi_cluster, namespace, "nvidia")
    assert all(inside in shown for inside in DRIVER_FILES)
    runtime_log = Path(cdi_cluster.node.log_path("nvidia-container-runtime")).read_text()
    assert "Using requested mode 'cdi'" in runtime_log
