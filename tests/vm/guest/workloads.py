"""Containers of the systemd node, as its engines make them (runs inside the VM only).

Each engine here uses the *systemd* cgroup driver, as on a production node:

- ``cri``: the node's containerd (``SystemdCgroup = true``) through its CRI API, as a kubelet
  drives it; the pod's ``cgroup_parent`` decides where systemd puts the scope —
  ``system.slice`` or a kubelet-style ``kubepods-besteffort-pod<uid>.slice``;
- ``podman``: podman with crun and ``--cgroup-manager=systemd`` (``machine.slice/libpod-*``;
  crun runs the workload one level down, in ``<scope>/container``).

What a workload sees is the proof: opening ``/dev/nvidia<N>`` (``c 195:N``, no driver behind
it) gives ENXIO when the device cgroup allows it and EPERM when it denies it.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

from tests.k8s import cri, image

CONTAINERD: Final = "unix:///run/containerd/containerd.sock"
CONTAINERD_CONFIG: Final = Path("/etc/containerd/config.toml")
RUNC_ROOT_CRI: Final = "/run/containerd/runc/k8s.io"
PODMAN_IMAGE: Final = "localhost/vm-busybox:1"
MEMORY_LIMIT: Final = "268435456"
_OPEN_ERRORS: Final = {
    "no such device or address": "ENXIO",
    "operation not permitted": "EPERM",
    "no such file": "ENOENT",  # busybox sh words ENOENT its own way
}


def sh(*argv: str, timeout: float = 120) -> str:
    """Run a command of the node; its output, or an AssertionError with what it said."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, f"{argv} exited {result.returncode}: {result.stderr}"
    return result.stdout


def open_verdict(returncode: int, output: str) -> str:
    """``OK``, ``ENXIO``, ``EPERM`` or ``ENOENT`` from a shell's ``exec 3<PATH``."""
    if returncode == 0:
        return "OK"
    for message, name in _OPEN_ERRORS.items():
        if message in output.lower():
            return name
    raise AssertionError(f"unexpected result of an open: {returncode} {output!r}")


class Workload(Protocol):
    """A running container of the node."""

    @property
    def pid(self) -> int: ...

    def exec(self, argv: list[str]) -> tuple[int, str]:
        """Run ``argv`` in the container: exit status and output (stdout and stderr)."""

    def runtime_update(self) -> None:
        """Change its memory limit with its OCI runtime's ``update`` (as kubelet's in-place
        resize ends up doing)."""

    def remove(self) -> None: ...


def open_in(workload: Workload, path: str) -> str:
    """What opening ``path`` for reading does inside the container (never creates it)."""
    return open_verdict(*workload.exec(["/bin/sh", "-c", f"exec 3<{path}"]))


def unit_of(pid: int) -> tuple[str, Path]:
    """The systemd unit of a container's process and its cgroup directory, from the kernel
    (crun's ``container`` sub-cgroup folded into its scope)."""
    path = Path(Path(f"/proc/{pid}/cgroup").read_text().strip().split("::", 1)[1])
    if path.name == "container":
        path = path.parent
    return path.name, Path("/sys/fs/cgroup") / path.relative_to("/")


@dataclass
class CriPod:
    """One pod with one ``sleep infinity`` container, through containerd's CRI API."""

    client: cri.CriClient
    cgroup_parent: str
    sandbox_id: str = ""
    container_id: str = ""
    _pid: int = 0

    def start(self) -> CriPod:
        p = cri.pb()
        uid = uuid.uuid4().hex
        parent = self.cgroup_parent.replace("{uid}", uid)
        config = p.PodSandboxConfig(
            metadata=p.PodSandboxMetadata(name=f"vm-{uid[:8]}", uid=uid, namespace="default"),
            linux=p.LinuxPodSandboxConfig(
                cgroup_parent=parent,
                security_context=p.LinuxSandboxSecurityContext(
                    namespace_options=p.NamespaceOption(network=p.NODE)
                ),
            ),
        )
        self.sandbox_id = self.client.run_pod_sandbox(config)
        container = p.ContainerConfig(
            metadata=p.ContainerMetadata(name="notebook"),
            image=p.ImageSpec(image=image.TOOLS_IMAGE),
            command=["/bin/sleep"],
            args=["infinity"],
        )
        self.container_id = self.client.create_container(self.sandbox_id, container, config)
        self.client.start_container(self.container_id)
        self._pid = self.client.container_status(self.container_id).pid
        return self

    @property
    def pid(self) -> int:
        return self._pid

    def exec(self, argv: list[str]) -> tuple[int, str]:
        result = self.client.exec_sync(self.container_id, argv, timeout=60)
        return result.exit_code, result.stdout + result.stderr

    def runtime_update(self) -> None:
        sh("runc", "--root", RUNC_ROOT_CRI, "update", "--memory", MEMORY_LIMIT, self.container_id)

    def remove(self) -> None:
        if self.sandbox_id:
            self.client.stop_pod_sandbox(self.sandbox_id)
            self.client.remove_pod_sandbox(self.sandbox_id)


def prepare_cri(directory: Path) -> cri.CriClient:
    """The node's CRI with the test images imported; the configured sandbox image is the
    busybox pause image (no registry is reachable)."""
    archive = directory / "images.tar"
    image.write_oci_archive(archive)
    sh("ctr", "-n", "k8s.io", "images", "import", str(archive), timeout=300)
    sandbox = re.search(r'sandbox_image = "([^"]+)"', CONTAINERD_CONFIG.read_text())
    assert sandbox is not None, "no sandbox_image in the node's containerd config"
    sh("ctr", "-n", "k8s.io", "images", "tag", "--force", image.PAUSE_IMAGE, sandbox.group(1))
    return cri.CriClient(CONTAINERD)


@dataclass
class PodmanContainer:
    """One ``sleep infinity`` container of podman + crun with the systemd cgroup manager."""

    name: str = field(default_factory=lambda: f"vm-{uuid.uuid4().hex[:8]}")
    container_id: str = ""
    _pid: int = 0

    def start(self) -> PodmanContainer:
        self.container_id = sh(
            "podman",
            "run",
            "--detach",
            "--runtime=crun",
            "--cgroup-manager=systemd",
            "--network=none",
            f"--name={self.name}",
            PODMAN_IMAGE,
            "/bin/sleep",
            "infinity",
        ).strip()
        self._pid = int(sh("podman", "inspect", "--format={{.State.Pid}}", self.name))
        return self

    @property
    def pid(self) -> int:
        return self._pid

    def exec(self, argv: list[str]) -> tuple[int, str]:
        result = subprocess.run(
            ["podman", "exec", self.name, *argv], capture_output=True, text=True, timeout=120
        )
        return result.returncode, result.stdout + result.stderr

    def runtime_update(self) -> None:
        sh("crun", "update", f"--memory={MEMORY_LIMIT}", self.container_id)

    def remove(self) -> None:
        subprocess.run(["podman", "rm", "--force", "--time=0", self.name], timeout=120, check=False)


def prepare_podman(directory: Path) -> None:
    """A busybox image for podman, imported from a rootfs (no registry)."""
    rootfs = directory / "rootfs.tar"
    with tarfile.open(rootfs, "w") as tar:
        for name in ("bin", "tmp", "proc", "sys", "dev", "etc", "run"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(image.BUSYBOX, arcname="bin/busybox")
        for applet in ("sh", "sleep", "head", "cat"):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    sh("podman", "import", str(rootfs), PODMAN_IMAGE, timeout=300)
