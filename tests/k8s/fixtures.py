"""pytest plugin of the Kubernetes tier: a real containerd, the fake control plane and a
simulated kubelet, wired together (registered in ``tests/conftest.py``).

Fixtures (see ``tests/k8s/README.md`` for a walk-through):

``containerd`` (session, root)
    A private containerd with the test images imported (``containerd.Containerd``:
    ``.endpoint``, ``.address``, ``.cgroup_top``, ``.ctr(...)``). Started once per session;
    at the end the session fails if a pod sandbox is still there (every kubelet removes its
    own) or containerd left anything (shims, mounts, cgroups) that had to be removed by force.
``kube`` (function)
    A fresh fake apiserver (``kube.FakeKube``: ``.url``, ``.kubeconfig_path``, ``.client()``,
    ``create_namespace``, ``add_token``, ``pod_token``, ``allow``, ``grant``,
    ``create_runtime_class``, ``create_priority_class``, ``pod``, ``wait_for_pod``...). No
    root needed.
``kubelet`` (function, root)
    A ``kubelet.KubeletSimulator`` for node ``KUBELET_NODE`` with four whole GPUs
    (``nvidia.com/gpu``) on ``kube`` and ``containerd``: ``.node_name``, ``.gpus``,
    ``.pod_resources_socket``, ``.cri_socket``, ``run_notebook_pod``, ``evict``, ``exec``,
    ``container_id``, ``container_info``, ``assignments``. At teardown it
    removes its pods from containerd and fails the test if it hit an error of its own.
``kubelet_factory`` (function, root)
    ``kubelet_factory(gpus=..., node_name=...)`` for another inventory (MIG resources, more
    GPUs, a second node).
``kubelet_nvml`` (function)
    A ``FakeNvmlNode`` (tests/fixtures/nvml.py) whose GPUs are ``kubelet``'s inventory, so
    an agent given ``kubelet_nvml.environ()`` maps device ids to the same minors
    (``nvml_node_for(kubelet, fake_nvml_library, directory)`` for a factory-made kubelet).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import pytest

from jupyter_gpu_hotplug.nvml.sim import write_config

from ..fixtures.nvml import FakeNvmlNode
from ..fixtures.requirements import ROOT_REASON, has_root_and_cgroups
from .apiserver.server import ApiServer
from .containerd import Containerd, cleanup_stale, start_containerd
from .cri import CriClient
from .inventory import DeviceGpu, nvml_config, whole_gpus
from .kube import FakeKube
from .kubelet import KubeletSimulator

KUBELET_NODE: Final = "k8stier-node"
DEFAULT_GPUS: Final = 4

KubeletFactory = Callable[..., KubeletSimulator]


def _short_tempdir(prefix: str) -> Path:
    """A fresh directory under /tmp: unix socket paths must stay under 107 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@pytest.fixture(scope="session")
def containerd() -> Iterator[Containerd]:
    """A private containerd for the session (see the module docstring)."""
    if not has_root_and_cgroups() or shutil.which("containerd") is None:
        pytest.skip(f"{ROOT_REASON}; and containerd, runc, busybox-static (apt)")
    cleanup_stale()
    daemon = start_containerd()
    left: list[str] = []
    try:
        yield daemon
    finally:
        with contextlib.suppress(Exception):
            cri = CriClient(daemon.endpoint)
            left.extend(
                f"sandbox {s.metadata.namespace}/{s.metadata.name}"
                for s in cri.list_pod_sandboxes()
            )
            cri.remove_all_pods()
            cri.close()
        left.extend(daemon.stop())
    assert not left, f"left behind at the end of the session (removed by force): {left}"


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    """A fresh fake apiserver for one test."""
    directory = _short_tempdir("k8stk-")
    server = ApiServer()
    server.start()
    try:
        yield FakeKube(server, directory)
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def kubelet_factory(kube: FakeKube, containerd: Containerd) -> Iterator[KubeletFactory]:
    started: list[tuple[KubeletSimulator, Path]] = []

    def start(
        *, gpus: tuple[DeviceGpu, ...] | None = None, node_name: str = KUBELET_NODE
    ) -> KubeletSimulator:
        directory = _short_tempdir("k8stl-")
        simulator = KubeletSimulator(
            kube,
            containerd,
            node_name=node_name,
            gpus=whole_gpus(DEFAULT_GPUS, node_name) if gpus is None else gpus,
            pod_resources_socket=directory / "kubelet.sock",
        )
        started.append((simulator, directory))
        simulator.start()
        return simulator

    yield start
    errors = []
    for simulator, directory in started:
        simulator.stop()
        errors.extend(simulator.errors)
        shutil.rmtree(directory, ignore_errors=True)
    assert not errors, f"the kubelet simulator failed: {errors}"


@pytest.fixture
def kubelet(kubelet_factory: KubeletFactory) -> KubeletSimulator:
    """The node's kubelet with four whole GPUs (see the module docstring)."""
    return kubelet_factory()


def nvml_node_for(kubelet: KubeletSimulator, library_dir: Path, directory: Path) -> FakeNvmlNode:
    """A fake-NVML config in ``directory`` with ``kubelet``'s GPUs (same UUIDs, same minors),
    for a kubelet made with ``kubelet_factory``; ``library_dir`` is ``fake_nvml_library``."""
    config = nvml_config(kubelet.gpus, kubelet.node_name)
    path = directory / f"nvml-{kubelet.node_name}.conf"
    write_config(path, config)
    return FakeNvmlNode(library_dir=library_dir, config_path=path, config=config)


@pytest.fixture
def kubelet_nvml(
    kubelet: KubeletSimulator, fake_nvml_library: Path, tmp_path: Path
) -> FakeNvmlNode:
    """The fake NVML config of ``kubelet``'s GPUs (same UUIDs, same minors)."""
    return nvml_node_for(kubelet, fake_nvml_library, tmp_path)
