"""containerd (Debian's 1.6, driven with its own ``ctr``) as the container engine of local-mode
tests: containers as a containerd client makes them, run by runc, outside Kubernetes.

The daemon is the test's own: config, root, state and socket under a temp dir, the CRI plugin
disabled (nothing here needs it), a containerd namespace of its own. Containers use
``ctr run --rootfs`` over a fresh copy of the busybox rootfs each (no image, no snapshotter, no
registry) and get containerd's default OCI spec: cgroupfs paths ``/<namespace>/<name>``,
containerd's default capabilities (with ``CAP_MKNOD``).
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from . import containers as base

START_TIMEOUT: Final = 60.0
CONFIG: Final = """version = 2
root = "{root}/root"
state = "{root}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{root}/containerd.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"
"""


def containerd_missing_reason() -> str | None:
    """Why no containerd test can run here, or None."""
    for command in ("containerd", "ctr", "runc"):
        if shutil.which(command) is None:
            return f"{command} is not installed (bash .ci/setup installs it)"
    if not base.BUSYBOX.exists():
        return "busybox-static is not installed (bash .ci/setup installs it)"
    return None


@dataclass
class Containerd(base.Engine):
    """A private containerd daemon and the containers a test runs in it."""

    namespace: str = field(default_factory=lambda: f"gpu-hotplug-test-{uuid.uuid4().hex[:8]}")
    daemon: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.root / "containerd.sock"

    def command(self, *args: str) -> list[str]:
        return ["ctr", f"--address={self.socket}", f"--namespace={self.namespace}", *args]

    def prepare(self) -> None:
        """Start the daemon and wait for its socket (``EngineUnavailable`` if it dies)."""
        config = self.root / "config.toml"
        config.write_text(CONFIG.format(root=self.root))
        base.build_rootfs_tar(self.root)
        with (self.root / "containerd.log").open("wb") as log:
            self.daemon = subprocess.Popen(
                ["containerd", f"--config={config}"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not self.socket.exists():
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise base.EngineUnavailable((self.root / "containerd.log").read_text())
            time.sleep(0.05)

    def probe_argv(self, spec: base.ProbeSpec) -> list[str]:
        rootfs = self.root / "rootfs" / spec.name  # one each: ``--rootfs`` uses it in place
        rootfs.mkdir(parents=True)
        with tarfile.open(self.root / "rootfs.tar") as tar:
            tar.extractall(rootfs, filter="tar")
        binds = [
            *(
                f"type=bind,src={h},dst={c},options=rbind:ro"
                for h, c in base.READ_ONLY_BINDS.items()
            ),
            *(f"type=bind,src={h},dst={c},options=rbind:rw" for h, c in spec.volumes.items()),
        ]
        return self.command(
            "run",
            "--rm",
            "--rootfs",
            *(f"--mount={bind}" for bind in binds),
            *(f"--env={key}={value}" for key, value in spec.environment.items()),
            *([] if spec.cap_mknod else ["--cap-drop=CAP_MKNOD"]),
            str(rootfs),
            spec.name,
            *base.PROBE_COMMAND,
        )

    def close(self) -> None:
        """Stop every container, then the daemon."""
        self.containers.stop_all()
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()

    def host_pid(self, name: str) -> int:
        # `ctr task ls`: TASK PID STATUS, one line per task.
        for line in self.run("task", "ls").splitlines()[1:]:
            task, pid, _ = line.split()
            if task == name:
                return int(pid)
        raise base.EngineUnavailable(f"no task {name} in containerd")

    def force_remove(self, name: str) -> None:
        subprocess.run(
            self.command("task", "kill", "--signal=SIGKILL", name),
            timeout=base.COMMAND_TIMEOUT,
            check=False,
        )
