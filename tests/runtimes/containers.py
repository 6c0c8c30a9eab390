"""What every container engine of these tests shares: the test image's rootfs, the probe as a
container's first process, and stopping it.

The image is a ``busybox-static`` rootfs made here (no registry); the host's ``/usr`` is bound
read-only so that the stdlib-only probe (:mod:`tests.fixtures.sandbox_probe`) runs on the host's
Python inside the container, and ``tests/`` read-only at ``/tests`` for the probe and the agent
client. Engines: :mod:`.podman` (CLI and Docker API) and :mod:`.containerd` (``ctr``).
"""

from __future__ import annotations

import subprocess
import tarfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from tests.fixtures.probe_client import ProbeClient

TESTS_DIR: Final = Path(__file__).resolve().parents[1]
BUSYBOX: Final = Path("/bin/busybox")
PROBE_COMMAND: Final = ("/usr/bin/python3", "-I", "-S", "/tests/fixtures/sandbox_probe.py")
"""The probe inside a container, on the host's Python from the bound ``/usr``."""
READ_ONLY_BINDS: Final = {"/usr": "/usr", str(TESTS_DIR): "/tests"}
COMMAND_TIMEOUT: Final = 120.0


class EngineUnavailable(Exception):
    """The engine or its runtime cannot run containers on this host (the message says why)."""


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


def launch_probe(name: str, argv: Sequence[str], host_pid: Callable[[str], int]) -> Container:
    """Start ``argv`` (an engine's "run this interactively" command whose process is the probe)
    and wait for the probe's greeting; ``host_pid(name)`` asks the engine for its host pid."""
    process = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    try:
        # The probe is the container's first process: pid 1 in its pid namespace.
        probe = ProbeClient(1, stdin=process.stdin, stdout=process.stdout)
        pid = host_pid(name)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return Container(name, process, probe, pid)


@dataclass
class Containers:
    """The containers a test started; the probe exits at end of input, ending its container."""

    force_remove: Callable[[str], None]
    running: list[Container] = field(default_factory=list)

    def stop(self, container: Container) -> None:
        if container.process.stdin is not None:
            container.process.stdin.close()
        try:
            container.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.force_remove(container.name)
            container.process.wait(timeout=30)
        if container.process.stdout is not None:
            container.process.stdout.close()

    def stop_all(self) -> None:
        while self.running:
            self.stop(self.running.pop())


@dataclass(frozen=True)
class ProbeSpec:
    """One probe container to run: its name, binds (host dir → container dir), environment."""

    name: str
    volumes: Mapping[str, str]
    environment: Mapping[str, str]
    cap_mknod: bool


@dataclass
class Engine:
    """What the tests ask of an engine; subclasses say how their CLI does it."""

    root: Path
    containers: Containers = field(init=False)

    def __post_init__(self) -> None:
        self.containers = Containers(self.force_remove)

    def command(self, *args: str) -> list[str]:
        """The engine's CLI with ``args``."""
        raise NotImplementedError

    def run(self, *args: str) -> str:
        """Run the CLI; its stdout, or ``EngineUnavailable`` with its stderr."""
        result = subprocess.run(
            self.command(*args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT
        )
        if result.returncode != 0:
            raise EngineUnavailable(
                f"{' '.join(self.command(*args)[:1])} {' '.join(args)}: {result.stderr.strip()}"
            )
        return result.stdout

    def prepare(self) -> None:
        """Get ready to run containers; ``EngineUnavailable`` says why it cannot."""
        raise NotImplementedError

    def start_probe(
        self,
        *,
        volumes: Mapping[str, str],
        environment: Mapping[str, str],
        cap_mknod: bool = True,
    ) -> Container:
        """A container running the probe, with ``volumes`` (host dir → container dir) besides
        the read-only binds; ``cap_mknod=False``: without ``CAP_MKNOD``."""
        name = f"gpu-hotplug-test-{uuid.uuid4().hex[:10]}"
        argv = self.probe_argv(ProbeSpec(name, volumes, environment, cap_mknod=cap_mknod))
        container = launch_probe(name, argv, self.host_pid)
        self.containers.running.append(container)
        return container

    def probe_argv(self, spec: ProbeSpec) -> list[str]:
        """The command that runs the probe interactively as container ``name``."""
        raise NotImplementedError

    def host_pid(self, name: str) -> int:
        """The host pid of container ``name``'s first process."""
        raise NotImplementedError

    def force_remove(self, name: str) -> None:
        """End container ``name`` whatever it does."""
        raise NotImplementedError
