"""One qemu VM of the systemd node, driven over ssh.

Why these choices:

- **TCG unless KVM really works.** KVM is used only where ``/dev/kvm`` is usable *and* the CPU
  offers hardware virtualization (``vmx``/``svm``); our machines' ``/dev/kvm`` is a nested
  software module that runs no stock kernel, so they emulate (TCG, 2 vCPUs, a 256 MiB
  translation cache instead of qemu's 1 GiB default).
- **snapshot=on**: the cached image is never written, so every session boots the same clean
  node and nothing needs cleaning up inside it.
- **The test virtualenv shared read-only (virtio-9p)**: the guest's Debian Python 3.11 runs the
  tests with exactly the host's third-party packages (same minor version, same glibc), without
  copying a few hundred MB over ssh. The project's source tree is *installed* into the guest
  (copied in), so the code under test is the tree's, nothing of the host's is imported.
- **ssh with a control master**: one TCP connection carries every command of the session.
- Boot and command deadlines are generous (a loaded 2-core host emulates 3x slower); they are
  deadlines for polling, never sleeps.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import socket
import subprocess
import sysconfig
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from .image import Image

__all__ = ["BOOT_TIMEOUT", "GUEST_TREE", "Machine", "MachineError", "Share", "boot", "use_kvm"]

BOOT_TIMEOUT: Final = 600.0
"""From qemu's start to a root shell over ssh: 20-70 s measured, 3x that under load."""
COMMAND_TIMEOUT: Final = 300.0
GUEST_TREE: Final = "/opt/jupyter-gpu-hotplug"
GUEST_DEPS: Final = "/opt/test-venv"
_DEPS_TAG: Final = "testvenv"
VCPUS: Final = 2
MEMORY: Final = "3G"
_TREE_PARTS: Final = ("pyproject.toml", "jupyter_gpu_hotplug", "tests")
_SKIP_IN_TREE: Final = ("__pycache__", ".pytest_cache", ".mypy_cache", "node_modules")


@dataclass(frozen=True)
class Share:
    """A host directory the guest mounts read-only over virtio-9p at ``guest_path``."""

    tag: str
    host_path: Path
    guest_path: str

    def mount_command(self) -> str:
        return (
            f"mkdir -p {shlex.quote(self.guest_path)} && mount -t 9p -o "
            "trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose "
            f"{self.tag} {shlex.quote(self.guest_path)}"
        )


class MachineError(Exception):
    """The VM did not start, or a command in it failed; the serial log's tail is included."""


def use_kvm(cpuinfo: Path = Path("/proc/cpuinfo"), kvm: Path = Path("/dev/kvm")) -> bool:
    """Whether hardware virtualization is really there (not just a ``/dev/kvm`` node)."""
    if not os.access(kvm, os.R_OK | os.W_OK):
        return False
    flags = re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.MULTILINE)
    return flags is not None and bool({"vmx", "svm"} & set(flags.group(1).split()))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Machine:
    """A running VM; :func:`boot` makes one."""

    image: Image
    run_dir: Path
    ssh_port: int
    process: subprocess.Popen[bytes]
    kvm: bool
    boot_seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def serial_log(self) -> Path:
        return self.run_dir / "serial.log"

    def _ssh_argv(self) -> list[str]:
        return [
            "ssh",
            "-p",
            str(self.ssh_port),
            "-i",
            str(self.image.ssh_key),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            "-o",
            "ControlMaster=auto",
            "-o",
            f"ControlPath={self.run_dir}/ssh-%C",
            "-o",
            "ControlPersist=yes",
            "-o",
            "ServerAliveInterval=15",
            "root@127.0.0.1",
        ]

    def run(
        self,
        command: str,
        *,
        timeout: float = COMMAND_TIMEOUT,
        check: bool = True,
        stdin: bytes | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a shell command in the guest as root."""
        result = subprocess.run(
            [*self._ssh_argv(), command],
            input=stdin.decode("latin-1") if stdin is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise MachineError(
                f"in the VM: {command!r} exited {result.returncode}\n"
                f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
            )
        return result

    def put(self, data: bytes | Path, command: str, *, timeout: float = COMMAND_TIMEOUT) -> None:
        """Feed ``data`` (bytes, or a file's content, streamed) to ``command`` in the guest."""
        with contextlib.ExitStack() as stack:
            source = stack.enter_context(data.open("rb")) if isinstance(data, Path) else None
            result = subprocess.run(
                [*self._ssh_argv(), command],
                input=data if isinstance(data, bytes) else None,
                stdin=source,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        if result.returncode != 0:
            raise MachineError(
                f"in the VM: {command!r} exited {result.returncode}: {result.stderr!r}"
            )

    def python_env(self) -> str:
        """The environment prefix under which the guest's Python runs the installed tree."""
        return (
            f"PYTHONPATH={GUEST_TREE}:{GUEST_DEPS} PYTHONDONTWRITEBYTECODE=1 "
            "PYTHONUNBUFFERED=1 GPU_HOTPLUG_TEST_IN_VM=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "
            "PATH=/usr/sbin:/usr/bin:/sbin:/bin"
        )

    def pytest(
        self, targets: Sequence[str], *, junit: str, extra: Sequence[str] = (), timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run pytest in the guest over the installed tree (never raises on test failures);
        plugins are not auto-loaded: ``extra`` names those wanted with ``-p``."""
        argv = [
            "python3",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rfEs",
            f"--junitxml={junit}",
            *extra,
            *targets,
        ]
        command = f"cd {GUEST_TREE} && {self.python_env()} {shlex.join(argv)}"
        return self.run(command, timeout=timeout, check=False)

    def serial_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.serial_log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no serial log)"

    def stop(self) -> None:
        """End qemu (the disk is a snapshot: nothing inside needs a clean shutdown)."""
        subprocess.run(
            [*self._ssh_argv()[:-1], "-O", "exit", "root@127.0.0.1"],
            capture_output=True,
            timeout=30,
            check=False,
        )
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def _qemu_argv(
    image: Image,
    run_dir: Path,
    port: int,
    *,
    kvm: bool,
    shares: Sequence[Share],
    nics: Sequence[str],
    vcpus: int,
) -> list[str]:
    accel = (
        ["-accel", "kvm", "-cpu", "host"]
        if kvm
        else ["-accel", "tcg,thread=multi,tb-size=256", "-cpu", "max"]
    )
    return [
        "qemu-system-x86_64",
        *accel,
        "-smp",
        str(vcpus),
        "-m",
        MEMORY,
        "-nodefaults",
        "-display",
        "none",
        "-no-reboot",
        "-kernel",
        str(image.kernel),
        "-initrd",
        str(image.initrd),
        "-append",
        "root=/dev/vda rw console=ttyS0 systemd.unified_cgroup_hierarchy=1 panic=-1",
        "-drive",
        f"file={image.rootfs},format=raw,if=virtio,snapshot=on,cache=unsafe",
        "-nic",
        f"user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:{port}-:22",
        *(arg for nic in nics for arg in ("-nic", nic)),
        *(
            arg
            for share in shares
            for arg in (
                "-virtfs",
                f"local,path={share.host_path},mount_tag={share.tag},"
                "security_model=none,readonly=on",
            )
        ),
        "-serial",
        f"file:{run_dir / 'serial.log'}",
    ]


def _tree_archive(root: Path) -> bytes:
    """The project's source tree (package, tests, pyproject) as a tar, without caches."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if any(p in _SKIP_IN_TREE for p in Path(info.name).parts) else info

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as archive:
        for part in _TREE_PARTS:
            archive.add(root / part, arcname=part, filter=keep)
    return buffer.getvalue()


@contextlib.contextmanager
def boot(
    image: Image,
    run_dir: Path,
    *,
    tree: Path | None,
    shares: Sequence[Share] = (),
    nics: Sequence[str] = (),
    vcpus: int = VCPUS,
    nice: int = 5,
) -> Iterator[Machine]:
    """Boot the image and wait for ssh; with ``tree``, share the test venv and install the
    tree; mount ``shares``; ``nics`` are further ``-nic`` options (the first, user networking
    with ssh forwarded, is always there). Stop at exit. ``nice``: the emulator's niceness (the
    VM tier yields to the tests beside it; a VM on a lane's longest path does not)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if tree is not None:
        deps = Path(sysconfig.get_paths()["purelib"])
        shares = (Share(_DEPS_TAG, deps, GUEST_DEPS), *shares)
    kvm = use_kvm()
    port = _free_port()
    started = time.monotonic()
    argv = _qemu_argv(image, run_dir, port, kvm=kvm, shares=shares, nics=nics, vcpus=vcpus)
    with (run_dir / "qemu.log").open("wb") as qemu_log:
        process = subprocess.Popen(
            ["nice", "-n", str(nice), *argv],
            stdin=subprocess.DEVNULL,
            stdout=qemu_log,
            stderr=subprocess.STDOUT,
        )
    machine = Machine(image, run_dir, port, process, kvm)
    try:
        _wait_for_ssh(machine, started)
        machine.boot_seconds = time.monotonic() - started
        if shares:
            machine.run(" && ".join(share.mount_command() for share in shares))
        if tree is not None:
            machine.put(_tree_archive(tree), f"mkdir -p {GUEST_TREE} && tar -xzf - -C {GUEST_TREE}")
        machine.timings["ready"] = time.monotonic() - started
        yield machine
    finally:
        machine.stop()


def _wait_for_ssh(machine: Machine, started: float) -> None:
    deadline = started + BOOT_TIMEOUT
    while True:
        if machine.process.poll() is not None:
            qemu_out = (machine.run_dir / "qemu.log").read_text(errors="replace")
            raise MachineError(
                f"qemu exited with {machine.process.returncode}: {qemu_out[-2000:]}\n"
                f"serial console:\n{machine.serial_tail()}"
            )
        try:
            if machine.run("true", timeout=30, check=False).returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            raise MachineError(
                f"no ssh into the VM {BOOT_TIMEOUT:g} s after qemu started "
                f"({'kvm' if machine.kvm else 'tcg'}); serial console:\n{machine.serial_tail()}"
            )
        time.sleep(1)  # poll interval between connection attempts, not a wait for state
