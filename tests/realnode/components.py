"""Where the real node's binaries are: the cache that ``build.sh`` fills, one directory per
component and version (``versions.env`` is the one list of versions).

Why a separate module: the node, the fixtures, the benchmark and the ``up``/``down`` command
all need the same answer, and a missing component must be reported the same way everywhere
(with the command that builds it), never guessed from ``PATH``.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

HERE: Final = Path(__file__).resolve().parent
VERSIONS_FILE: Final = HERE / "versions.env"
BUILD_SCRIPT: Final = HERE / "build.sh"
CACHE_ENV: Final = "JGH_NODE_CACHE"
"""Overrides the cache root, as in ``build.sh``."""
BUILD_POLL: Final = 2.0
"""Seconds between two looks at a running build (a component takes a minute or more)."""


class MissingComponents(RuntimeError):
    """A component is not built: the message names it and the command that builds it."""


def versions() -> dict[str, str]:
    """``versions.env`` as a mapping (``KUBERNETES_VERSION`` → ``v1.37.2`` ...)."""
    pairs = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key] = value
    return pairs


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache/jupyter-gpu-hotplug/node")


@dataclass(frozen=True)
class ContainerToolkit:
    """NVIDIA Container Toolkit's binaries (the node's CDI mode and its generated spec)."""

    nvidia_ctk: Path
    nvidia_container_runtime: Path
    nvidia_cdi_hook: Path

    @classmethod
    def in_directory(cls, directory: Path) -> ContainerToolkit:
        names = ("nvidia-ctk", "nvidia-container-runtime", "nvidia-cdi-hook")
        return cls(*(directory / name for name in names))


@dataclass(frozen=True)
class Components:
    """Absolute paths of every binary the node runs."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubelet: Path
    kube_proxy: Path
    etcd: Path
    containerd: Path
    containerd_shim: Path
    runc: Path
    crictl: Path
    cni_bin_dir: Path
    device_plugin: Path
    helm: Path
    container_toolkit: ContainerToolkit
    versions: dict[str, str]

    @property
    def path_dirs(self) -> list[str]:
        """Directories to put first on a component's ``PATH`` (containerd finds its shim and
        the shim its runc there)."""
        return sorted({str(p.parent) for p in (self.containerd, self.runc, self.crictl)})


def build_running() -> bool:
    """Whether ``build.sh`` is building into this cache now (it holds ``.build.lock``
    exclusively for the whole of a run)."""
    lock = cache_root() / ".build.lock"
    try:
        descriptor = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)  # closing releases a lock taken
    return False


def _component_dir(name: str, key: str, pinned: dict[str, str]) -> Path:
    """``bin/<name>-<version>`` once built, else ``MissingComponents`` with the command.

    While ``build.sh`` runs it waits for the component: ``.ci/test``'s real-node lane starts
    its tests beside a cold build (those that need nothing it builds run meanwhile), and a test
    that needs the node waits here for what it needs, not for the whole build."""
    path = cache_root() / "bin" / f"{name}-{pinned[key]}"
    while not (path / ".built").exists() and build_running():
        time.sleep(BUILD_POLL)  # poll interval: the build's own stamp says when it is done
    if not (path / ".built").exists():
        raise MissingComponents(
            f"{name} {pinned[key]} is not built in {path}: run `bash {BUILD_SCRIPT}` "
            "(builds every pinned component from the Go module proxy, once per version)"
        )
    return path


def find_container_toolkit() -> ContainerToolkit:
    """NVIDIA Container Toolkit alone (what a test that only generates a CDI spec needs), or
    ``MissingComponents``."""
    pinned = versions()
    return ContainerToolkit.in_directory(
        _component_dir("nvidia-container-toolkit", "CONTAINER_TOOLKIT_VERSION", pinned)
    )


def find_components() -> Components:
    """The built components, or ``MissingComponents`` saying what to build."""
    pinned = versions()

    def directory(name: str, key: str) -> Path:
        return _component_dir(name, key, pinned)

    kubernetes = directory("kubernetes", "KUBERNETES_VERSION")
    containerd = directory("containerd", "CONTAINERD_VERSION")
    return Components(
        kube_apiserver=kubernetes / "kube-apiserver",
        kube_controller_manager=kubernetes / "kube-controller-manager",
        kube_scheduler=kubernetes / "kube-scheduler",
        kubelet=kubernetes / "kubelet",
        kube_proxy=kubernetes / "kube-proxy",
        etcd=directory("etcd", "ETCD_VERSION") / "etcd",
        containerd=containerd / "containerd",
        containerd_shim=containerd / "containerd-shim-runc-v2",
        runc=directory("runc", "RUNC_VERSION") / "runc",
        crictl=directory("crictl", "CRICTL_VERSION") / "crictl",
        cni_bin_dir=directory("cni-plugins", "CNI_PLUGINS_VERSION"),
        device_plugin=directory("nvidia-device-plugin", "DEVICE_PLUGIN_VERSION")
        / "nvidia-device-plugin",
        helm=directory("helm", "HELM_VERSION") / "helm",
        container_toolkit=find_container_toolkit(),
        versions=pinned,
    )
