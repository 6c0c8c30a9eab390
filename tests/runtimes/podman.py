"""podman as the container engine of local-mode tests: its CLI, and its Docker-compatible API
for DockerSpawner.

Why podman: it runs rootful containers without a daemon, from a private storage root per test
session (``--root``/``--runroot`` under a temp dir, the ``vfs`` driver: nothing of ours mixes
with other users of the host, nothing is left mounted). Flags this host needs (ENVIRONMENT.md):
``--network none`` (no CNI), explicit ``--ulimit`` values (runc and crun refuse podman's
defaults here) and, unless a test asks for podman's defaults, ``--cap-add MKNOD`` so the test's
own ``mknod`` inside a container is judged by the device cgroup only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from .containers import (
    BUSYBOX,
    COMMAND_TIMEOUT,
    PROBE_COMMAND,
    READ_ONLY_BINDS,
    Engine,
    EngineUnavailable,
    ProbeSpec,
    build_rootfs_tar,
)

IMAGE: Final = "localhost/gpu-hotplug-test:busybox"
SERVICE_START_TIMEOUT: Final = 60.0


def podman_missing_reason() -> str | None:
    """Why no podman test can run here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (bash .ci/setup installs it)"
    if not BUSYBOX.exists():
        return "busybox-static is not installed (bash .ci/setup installs it)"
    return None


@dataclass
class Podman(Engine):
    """podman over a private storage root, with one OCI runtime."""

    runtime: str = "runc"

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

    def prepare(self) -> None:
        """Import the test image, and run one trivial container: ``EngineUnavailable`` says
        why the runtime cannot."""
        self.run("import", str(build_rootfs_tar(self.root)), IMAGE)
        self.run("run", "--rm", *self._run_flags(), IMAGE, "/bin/busybox", "true")

    def probe_argv(self, spec: ProbeSpec) -> list[str]:
        return self.command(
            "run",
            "-i",
            "--rm",
            f"--name={spec.name}",
            *self._run_flags(cap_mknod=spec.cap_mknod),
            *(f"--volume={host}:{inside}:ro" for host, inside in READ_ONLY_BINDS.items()),
            *(f"--volume={host}:{inside}" for host, inside in spec.volumes.items()),
            *(f"--env={key}={value}" for key, value in spec.environment.items()),
            IMAGE,
            *PROBE_COMMAND,
        )

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
                raise EngineUnavailable((self.root / "service.log").read_text())
            time.sleep(0.05)
        return service

    def host_pid(self, name: str) -> int:
        return int(json.loads(self.run("inspect", "--format={{json .State}}", name))["Pid"])

    def force_remove(self, name: str) -> None:
        subprocess.run(self.command("rm", "--force", name), timeout=COMMAND_TIMEOUT, check=False)

    def _run_flags(self, *, cap_mknod: bool = True) -> list[str]:
        return [
            f"--runtime={self.runtime}",
            "--network=none",
            "--ulimit=nofile=1024:1024",
            "--ulimit=nproc=1024:1024",
            *(["--cap-add=MKNOD"] if cap_mknod else []),
        ]
