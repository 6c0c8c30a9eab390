"""Real containers for local-mode tests: Debian's podman with runc (or crun), no registry.

Why podman: it runs rootful containers without a daemon, from a private storage root per test
session (``--root``/``--runroot`` under a temp dir, the ``vfs`` driver: nothing of ours mixes
with other users of the host, nothing is left mounted). The image is a ``busybox-static`` rootfs
made here and loaded with ``podman import``; the host's ``/usr`` is bound read-only so that the
stdlib-only probe (:mod:`tests.fixtures.sandbox_probe`) runs on the host's Python inside the
container. Flags this host needs (ENVIRONMENT.md): ``--network none`` (no CNI), explicit
``--ulimit`` values (crun and runc refuse podman's defaults here) and, unless a test asks for
podman's defaults, ``--cap-add MKNOD`` so the test's own ``mknod`` inside a container is judged
by the device cgroup only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from tests.fixtures.probe_client import ProbeClient

TESTS_DIR: Final = Path(__file__).resolve().parents[1]
IMAGE: Final = "localhost/gpu-hotplug-test:busybox"
BUSYBOX: Final = Path("/bin/busybox")
PROBE_IN_CONTAINER: Final = "/tests/fixtures/sandbox_probe.py"
COMMAND_TIMEOUT: Final = 120.0
SERVICE_START_TIMEOUT: Final = 60.0


class PodmanUnavailable(Exception):
    """podman or the runtime cannot run containers on this host (the message says why)."""


def podman_missing_reason() -> str | None:
    """Why no podman test can run here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (bash .ci/setup installs it)"
    if not BUSYBOX.exists():
        return "busybox-static is not installed (bash .ci/setup installs it)"
    return None


def build_rootfs_tar(directory: Path) -> Path:
    """A minimal rootfs: busybox, the mount points, and /lib links into the bound /usr."""
    tar_path = directory / "rootfs.tar"
    with tarfile.open(tar_path, "w") as tar:
        for name in ("bin", "usr", "tmp", "proc", "sys", "dev", "etc", "run", "tests"):
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if name == "tmp" else 0o755
            tar.addfile(info)
        tar.add(BUSYBOX, arcname="bin/busybox")
        for name, target in (("bin/sh", "busybox"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return tar_path


@dataclass
class Container:
    """A running container whose first process is the probe."""

    name: str
    process: subprocess.Popen[bytes]
    probe: ProbeClient
    pid: int
    """The probe's pid on the host (what the agent's resolver sees)."""

    def cgroup_dir(self, controller: str, mount: Path) -> Path:
        """The container's directory in a v1 ``controller`` hierarchy ("" for cgroup2)."""
        for line in Path(f"/proc/{self.pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(",") or controllers == controller:
                return mount / path.lstrip("/")
        raise LookupError(f"no {controller or 'cgroup2'} line for {self.name}")


@dataclass
class Podman:
    """podman over a private storage root, with one OCI runtime."""

    root: Path
    runtime: str
    containers: list[Container] = field(default_factory=list)

    def command(self, *args: str) -> list[str]:
        return [
            "podman",
            f"--root={self.root / 'storage'}",
            f"--runroot={self.root / 'run'}",
            f"--tmpdir={self.root / 'tmp'}",
            "--storage-driver=vfs",
            "--cgroup-manager=cgroupfs",
            "--events-backend=file",
            *args,
        ]

    def run(self, *args: str) -> str:
        result = subprocess.run(
            self.command(*args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT
        )
        if result.returncode != 0:
            raise PodmanUnavailable(f"podman {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def import_image(self) -> None:
        self.run("import", str(build_rootfs_tar(self.root)), IMAGE)

    def check_runtime(self) -> None:
        """Run one trivial container: ``PodmanUnavailable`` says why the runtime cannot."""
        self.run("run", "--rm", *self._run_flags(), IMAGE, "/bin/busybox", "true")

    def start_probe(
        self,
        *,
        volumes: Mapping[str, str],
        environment: Mapping[str, str],
        cap_mknod: bool = True,
    ) -> Container:
        """A container running the probe, with ``volumes`` (host dir → container dir);
        ``cap_mknod=False``: podman's default capabilities (no ``CAP_MKNOD``)."""
        name = f"gpu-hotplug-test-{uuid.uuid4().hex[:10]}"
        argv = self.command(
            "run",
            "-i",
            "--rm",
            f"--name={name}",
            *self._run_flags(cap_mknod=cap_mknod),
            "--volume=/usr:/usr:ro",
            f"--volume={TESTS_DIR}:/tests:ro",
            *(f"--volume={host}:{inside}" for host, inside in volumes.items()),
            *(f"--env={key}={value}" for key, value in environment.items()),
            IMAGE,
            "/usr/bin/python3",
            "-I",
            "-S",
            PROBE_IN_CONTAINER,
        )
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert process.stdin is not None and process.stdout is not None
        try:
            # The probe is the container's first process: pid 1 in its pid namespace.
            probe = ProbeClient(1, stdin=process.stdin, stdout=process.stdout)
            state = json.loads(self.run("inspect", "--format={{json .State}}", name))
        except BaseException:
            process.kill()
            process.wait()
            raise
        container = Container(name, process, probe, int(state["Pid"]))
        self.containers.append(container)
        return container

    def start_service(self, socket_path: Path) -> subprocess.Popen[bytes]:
        """podman's Docker-compatible API on ``socket_path`` (what DockerSpawner talks to),
        with this runtime as the default for the containers it creates."""
        log = (self.root / "service.log").open("wb")
        service = subprocess.Popen(
            self.command(
                f"--runtime={self.runtime}",
                "system",
                "service",
                "--time=0",
                f"unix://{socket_path}",
            ),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + SERVICE_START_TIMEOUT
        while not socket_path.exists():
            if service.poll() is not None or time.monotonic() > deadline:
                service.kill()
                service.wait()
                raise PodmanUnavailable((self.root / "service.log").read_text())
            time.sleep(0.05)
        return service

    def stop(self, container: Container) -> None:
        if container.process.stdin is not None:
            container.process.stdin.close()  # the probe exits at end of input
        try:
            container.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            subprocess.run(self.command("rm", "--force", container.name), timeout=60)
            container.process.wait(timeout=30)
        if container.process.stdout is not None:
            container.process.stdout.close()

    def stop_all(self) -> None:
        while self.containers:
            self.stop(self.containers.pop())

    def _run_flags(self, *, cap_mknod: bool = True) -> list[str]:
        return [
            f"--runtime={self.runtime}",
            "--network=none",
            "--ulimit=nofile=1024:1024",
            "--ulimit=nproc=1024:1024",
            *(["--cap-add=MKNOD"] if cap_mknod else []),
        ]
