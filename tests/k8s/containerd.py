"""A private containerd (Debian's 1.6, CRI plugin) for one test session, and its clean removal.

Why: the agent's CRI client and resolver must face a real runtime's answers and runc's real
cgroups and device rules. Everything containerd would keep under ``/var/lib``, ``/run``,
``/opt`` or ``/etc/cni`` goes into one short temporary directory (unix socket paths must stay
under 107 bytes), so it never meets another containerd on the host. Its shims still put their
sockets under ``/run/containerd/s/`` (hashed per address, so no collision). Pod cgroups go
below a per-session top directory (``kubepods-k8stier-<token>``), which teardown removes in
every hierarchy.

Pitfalls met on these machines (``shared/ENVIRONMENT.md``): root lacks ``CAP_SYS_RESOURCE``,
so ``restrict_oom_score_adj`` must be on or runc fails to lower a sandbox's OOM score; the
``native`` snapshotter is used because an overlay on the temp dir's filesystem may be refused
(and it leaves no overlay mounts behind); ``ctr images import --snapshotter`` must name the
snapshotter CRI uses.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from .image import PAUSE_IMAGE, write_oci_archive

SNAPSHOTTER: Final = "native"
NAMESPACE: Final = "k8s.io"
"""containerd namespace the CRI plugin uses."""
_START_TIMEOUT: Final = 30.0
_STOP_TIMEOUT: Final = 10.0


def cgroup_mount_points() -> list[Path]:
    """Every cgroup hierarchy's mount point (v1 controllers and cgroup2), from mountinfo."""
    points = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        if after.split()[0] in ("cgroup", "cgroup2"):
            points.add(Path(before.split()[4]))
    return sorted(points)


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below ``root``, deepest first."""
    found = [
        Path(line.split()[4]) for line in Path("/proc/self/mountinfo").read_text().splitlines()
    ]
    inside = [m for m in found if m == root or root in m.parents]
    return sorted(inside, key=lambda m: len(m.parts), reverse=True)


def pids_mentioning(needle: str) -> list[int]:
    """Processes whose command line contains ``needle`` (our containerd and its shims)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def remove_cgroup_tree(top: str) -> list[Path]:
    """Remove ``top`` (e.g. ``/kubepods-k8stier-ab12``) from every hierarchy, killing anything
    still in it; returns what could not be removed."""
    left = []
    for mount in cgroup_mount_points():
        root = mount / top.strip("/")
        if not root.is_dir():
            continue
        for directory, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                for pid in Path(directory, "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            for _ in range(100):  # a killed task leaves its cgroup asynchronously
                try:
                    os.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                left.append(Path(directory))
    return left


def spawn_logged(
    argv: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a daemon in a session of its own (so ``terminate_group`` can signal it), its
    output appended to ``log_path`` and ``env`` added to this process's environment."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )


def terminate_group(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM to the process group of a daemon that ``spawn_logged`` started, SIGKILL after
    ``timeout`` seconds; returns once it has exited."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@dataclass
class Containerd:
    """One running containerd: its socket, directories and the cgroup top of its pods."""

    directory: Path
    process: subprocess.Popen[bytes]
    cgroup_top: str
    """Cgroup directory (relative to each hierarchy's root) that holds every pod's cgroup."""
    images: tuple[str, ...] = ()
    _stopped: bool = field(default=False, repr=False)

    @property
    def address(self) -> Path:
        """containerd's gRPC socket, which also serves CRI (``unix://`` + this)."""
        return self.directory / "containerd.sock"

    @property
    def endpoint(self) -> str:
        """The CRI endpoint as kubelet's ``--container-runtime-endpoint`` spells it."""
        return f"unix://{self.address}"

    @property
    def log_path(self) -> Path:
        return self.directory / "containerd.log"

    def ctr(self, *args: str) -> str:
        """Run ``ctr`` against this containerd (namespace ``k8s.io``); returns its output."""
        return subprocess.run(
            ["ctr", "--address", str(self.address), "--namespace", NAMESPACE, *args],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def stop(self) -> list[str]:
        """Stop containerd and remove everything it made; returns what was left behind
        (and had to be removed by force): shims, mounts, cgroups."""
        if self._stopped:
            return []
        self._stopped = True
        terminate_group(self.process, _STOP_TIMEOUT)
        return remove_instance(self.directory, self.cgroup_top)


def remove_instance(directory: Path, cgroup_top: str) -> list[str]:
    """Kill every process that names ``directory`` (shims outlive containerd when a pod was
    not removed), unmount what is mounted below it, remove its cgroups and the directory;
    returns what had to be removed this way."""
    leftovers: list[str] = []
    for pid in pids_mentioning(f"{directory}/"):
        leftovers.append(f"process {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for mount in mounts_under(directory):
        leftovers.append(f"mount {mount}")
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
    leftovers.extend(f"cgroup {p}" for p in remove_cgroup_tree(cgroup_top))
    shutil.rmtree(directory, ignore_errors=True)
    return leftovers


_OWNER_FILE: Final = "owner"
"""In each instance's directory: ``<pid> <start time>`` of the process that started it, and
its cgroup top, so a later session can tell an orphan from a live instance of another run."""


def _process_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def cleanup_stale(parent: Path | None = None) -> list[Path]:
    """Stop and remove the instances whose starting process is gone (a killed test run);
    instances of live runs (other sessions on this host) are left alone. Returns what it
    removed."""
    removed = []
    for directory in Path(os.path.realpath(parent or "/tmp")).glob("k8st-*"):
        try:
            pid, start, cgroup_top = (directory / _OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue
        if _process_start(int(pid)) == start:
            continue
        remove_instance(directory, cgroup_top)  # its containerd goes too: it names the directory
        removed.append(directory)
    return removed


def _config(directory: Path) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    runc = f"{cri}.containerd.runtimes.runc"
    return f"""version = 2
root = "{directory}/root"
state = "{directory}/state"
[grpc]
  address = "{directory}/containerd.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "{directory}/opt"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  disable_apparmor = true
[{cri}.cni]
  bin_dir = "{directory}/cni/bin"
  conf_dir = "{directory}/cni/net.d"
[{cri}.containerd]
  snapshotter = "{SNAPSHOTTER}"
  default_runtime_name = "runc"
[{runc}]
  runtime_type = "io.containerd.runc.v2"
[{runc}.options]
  SystemdCgroup = false
  Root = "{directory}/runc"
"""


def start_containerd(parent: Path | None = None) -> Containerd:
    """Start a private containerd with the test images imported; raises ``RuntimeError`` with
    containerd's log when it does not come up. The caller must ``stop()`` it."""
    directory = Path(os.path.realpath(parent or "/tmp")) / f"k8st-{secrets.token_hex(3)}"
    directory.mkdir(mode=0o700)
    (directory / "config.toml").write_text(_config(directory))
    process = spawn_logged(
        ["containerd", "--config", str(directory / "config.toml")], directory / "containerd.log"
    )
    daemon = Containerd(directory, process, f"/kubepods-k8stier-{secrets.token_hex(3)}")
    me = os.getpid()
    (directory / _OWNER_FILE).write_text(f"{me} {_process_start(me)} {daemon.cgroup_top}\n")
    try:
        _wait_ready(daemon)
        archive = directory / "images.tar"
        names = write_oci_archive(archive)
        daemon.ctr("images", "import", "--snapshotter", SNAPSHOTTER, str(archive))
        archive.unlink()
        daemon.images = names
    except BaseException:
        daemon.stop()
        raise
    return daemon


def _wait_ready(daemon: Containerd) -> None:
    deadline = time.monotonic() + _START_TIMEOUT
    while True:
        if daemon.process.poll() is not None:
            raise RuntimeError(f"containerd exited early:\n{daemon.log_tail()}")
        with contextlib.suppress(subprocess.SubprocessError):
            plugins = daemon.ctr("plugins", "ls")
            cri = [line.split() for line in plugins.splitlines() if " cri " in line]
            if cri and cri[0][-1] == "ok":
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"containerd's CRI plugin is not ok:\n{daemon.log_tail()}")
        time.sleep(0.1)
