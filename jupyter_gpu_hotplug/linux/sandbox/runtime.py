"""Container-like sandboxes: run a command in fresh device cgroups with a private ``/dev``.

Boundary: this module creates and destroys sandboxes on *this* host — cgroup directories
with a device policy (v1 ``devices`` and/or a cgroup2 eBPF program), a process started in
its own mount namespace whose ``/dev`` is a private tmpfs holding only what a container
gets — and knows nothing of Jupyter, Kubernetes or the agent. The in-sandbox half lives in
:mod:`._init`.

Why it exists: local mode runs every Jupyter kernel in one of these, so that attaching a
GPU to "a kernel" means what it means for a container in Kubernetes — allow the device in
the kernel's cgroups and create its node in the kernel's mount namespace — and the same
injector code serves both. The test suite uses it as its stand-in for a container.

A boundary between kernels, as far as a container without user namespaces is one: like
Docker's defaults, the workload keeps only Docker's default capability set (bounding set
included: no ``CAP_SYS_ADMIN``, ``CAP_SYS_PTRACE``, ``CAP_SYS_MODULE``...), so even as root it
cannot mount, unmount, load programs or modules, or trace processes outside; it sees the host's
filesystem read-only except its working directory, home, ``/tmp``, ``/var/tmp``, its own
``/dev`` and ``/proc`` but for the host's sysctls (so ``/sys/fs/cgroup`` cannot be written: it
cannot leave its device cgroup); and the
``hidden`` paths (the agent's state directory, with its token and ledger) are covered by an
empty tmpfs. It has a pid namespace of its own — its ``/proc`` shows its own process tree
only, and no process outside can be named, so none can be signalled (the agent above all) —
and Docker's default seccomp restrictions, as a filter: no ``unshare``/``setns``/``clone`` of a
namespace (no user namespace in which it would hold every capability), no ``mount``, ``bpf``,
``ptrace``, module or kexec loading, clock, swap or keyring calls (``_init``). It
shares the host's network namespace (the agent's socket and TCP port). Give ``uid``/``gid`` to
run the command unprivileged as well.

Its shape, as the caller sees it: ``pid`` is an outer process in the caller's pid namespace
(the one that stands for the sandbox: the agent's target, the provisioner's kernel pid) that
relays signals to the sandbox's init (pid 1 inside), which relays them to the command's
process group (pid 2) and reaps orphans; the command learns the outer pid from
``GPU_HOTPLUG_SANDBOX_PID``.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, NewType

from ..._structs import SANDBOX_PID_ENV
from .. import cgroup_v1, cgroup_v2, cgroups, devnodes, procfs
from ..devrules import CONTAINER_DEFAULTS, RW, DeviceRule
from . import _init

SandboxName = NewType("SandboxName", str)
"""A sandbox's cgroup directory name: ``<prefix>.<owner pid>-<owner start>.<token>``."""

DEFAULT_CGROUP_PARENT: Final = "gpu-hotplug-sandboxes"
"""Directory, below each hierarchy's mount point, that holds all sandbox cgroups."""

DEFAULT_START_TIMEOUT: Final = 30.0
DEFAULT_STOP_TIMEOUT: Final = 5.0
#: After SIGKILL the kernel needs a moment to tear processes down; more means a bug.
_KILL_GRACE: Final = 10.0
_KILL_ROUND: Final = 0.5
_POLL_MIN: Final = 0.002
_POLL_MAX: Final = 0.05

DOCKER_DEFAULT_CAPABILITIES: Final = frozenset(
    {
        0,  # CAP_CHOWN
        1,  # CAP_DAC_OVERRIDE
        3,  # CAP_FOWNER
        4,  # CAP_FSETID
        5,  # CAP_KILL
        6,  # CAP_SETGID
        7,  # CAP_SETUID
        8,  # CAP_SETPCAP
        10,  # CAP_NET_BIND_SERVICE
        13,  # CAP_NET_RAW
        18,  # CAP_SYS_CHROOT
        27,  # CAP_MKNOD
        29,  # CAP_AUDIT_WRITE
        31,  # CAP_SETFCAP
    }
)
"""The capabilities Docker (moby ``oci/caps/defaults.go``) leaves a container by default."""

DEFAULT_HIDDEN: Final = ("/var/lib/gpu-hotplug",)
"""Paths a sandbox never sees by default: the agent's default state directory (token, ledger)."""

# /proc as in Docker: writable (a process may set its own oom_score_adj, comm...), but its
# host-wide parts (sysctls...) stay read-only: see _init.PROC_READ_ONLY.
_ALWAYS_WRITABLE: Final = ("/tmp", "/var/tmp", "/proc")
_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,64}")
_INIT_SCRIPT: Final = Path(_init.__file__)


class Backend(enum.Enum):
    """A device-cgroup mechanism; hybrid hosts enforce both at once."""

    V1 = "v1"
    """The cgroup v1 ``devices`` controller (``devices.allow``/``devices.deny``)."""
    V2 = "v2"
    """A ``BPF_PROG_TYPE_CGROUP_DEVICE`` program on a cgroup2 directory."""


class SandboxError(Exception):
    """Base of this module's errors."""


class SandboxUnsupportedError(SandboxError):
    """This host lacks what the spec asks for (a cgroup hierarchy, a feature)."""


class SandboxStartError(SandboxError):
    """The sandbox could not be set up or its command not executed; nothing is left behind.

    ``step`` names the failed step (``cgroup-v1``, ``cgroup-v2``, ``spawn``, ``timeout``,
    or one of the bootstrap's: ``unshare``, ``mount-dev``, ``join-cgroup``, ``chdir``,
    ``exec``, ...); ``errno`` is the kernel's error number when there is one.
    """

    def __init__(self, message: str, *, step: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.errno = errno_


class SandboxStopError(SandboxError):
    """Processes survived SIGKILL or a cgroup could not be removed."""


@dataclass(frozen=True)
class SandboxSpec:
    """What to run and how to confine it. Only ``argv`` is required."""

    argv: tuple[str, ...]
    _: KW_ONLY
    env: Mapping[str, str] | None = None
    """The command's whole environment; ``None`` passes on this process's."""
    cwd: str | None = None
    """Working directory, resolved inside the sandbox; ``None`` keeps this process's."""
    backends: frozenset[Backend] | None = None
    """``None`` uses every device-cgroup mechanism this host has, as runc does."""
    rules: tuple[DeviceRule, ...] = CONTAINER_DEFAULTS
    """The device policy: by default what every OCI container may use; no GPU."""
    nvidia_control_nodes: bool = True
    """Recreate the host's NVIDIA control nodes (if it has them) in ``/dev`` and allow them,
    like a container with ``NVIDIA_VISIBLE_DEVICES=none``. GPUs are never added here."""
    name_prefix: str = "sandbox"
    """First part of the cgroup directory name, for telling owners apart and for
    :func:`cleanup_stale`. Letters, digits, ``_`` and ``-``."""
    cgroup_parent: str = DEFAULT_CGROUP_PARENT
    """Relative path, below each hierarchy's mount point, of the sandboxes' parent cgroup."""
    uid: int | None = None
    gid: int | None = None
    groups: tuple[int, ...] | None = None
    """Supplementary groups; ``None`` means none when ``uid`` or ``gid`` is given."""
    capabilities: frozenset[int] | None = DOCKER_DEFAULT_CAPABILITIES
    """Capability numbers the workload may hold (bounding set included); ``None``: all."""
    read_only: bool = True
    """Show the host's filesystem read-only, but for the working directory, ``$HOME``,
    ``/tmp``, ``/var/tmp``, ``/dev``, ``/proc`` (not its sysctls) and ``writable``."""
    writable: tuple[str, ...] = ()
    """More paths that stay writable in a read-only view."""
    hidden: tuple[str, ...] = DEFAULT_HIDDEN
    """Paths covered by an empty tmpfs (a file: by an empty one), e.g. the agent's state dir."""
    end_with_owner: bool = False
    """End the sandbox (SIGKILL) when the process that started it exits, as a kernel ends with
    its Jupyter server (checked once a second)."""

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("a sandbox needs a command: argv is empty")
        if _PREFIX.fullmatch(self.name_prefix) is None:
            raise ValueError(
                f"invalid name prefix {self.name_prefix!r}: use 1-64 letters, digits, _ or -"
            )
        parent = Path(self.cgroup_parent)
        if parent.is_absolute() or not parent.parts or ".." in parent.parts:
            raise ValueError(f"cgroup parent {self.cgroup_parent!r} must be a relative path")
        if self.backends is not None and not self.backends:
            raise ValueError("backends must name at least one Backend (or be None)")


@dataclass(frozen=True)
class SandboxCgroups:
    """The cgroup directories of one sandbox (``None``: that backend is not used)."""

    v1: Path | None
    """Its directory in the v1 ``devices`` hierarchy."""
    v2: Path | None
    """Its cgroup2 directory, which carries the device program."""
    v2_program: cgroup_v2.ProgId | None = None
    """The id of the device program attached at ``v2`` (it goes when the directory goes)."""

    def dirs(self) -> tuple[Path, ...]:
        return tuple(d for d in (self.v1, self.v2) if d is not None)


def host_backends(hierarchies: cgroups.CgroupHierarchies | None = None) -> frozenset[Backend]:
    """The device-cgroup mechanisms this host enforces (both on a hybrid host)."""
    found = cgroups.discover() if hierarchies is None else hierarchies
    backends = set()
    if found.devices_v1 is not None:
        backends.add(Backend.V1)
    if found.unified is not None:
        backends.add(Backend.V2)
    return frozenset(backends)


def effective_rules(
    rules: Iterable[DeviceRule], nodes: Iterable[devnodes.DeviceNode]
) -> tuple[DeviceRule, ...]:
    """``rules`` plus read/write access to each extra node the sandbox gets."""
    return (*rules, *(node.device.rule(RW) for node in nodes))


class Sandbox:
    """One running sandbox. Create with :meth:`start`; always :meth:`stop` (or use ``with``).

    The process handle mirrors :class:`subprocess.Popen` where a kernel provisioner needs
    it (``pid``, ``poll``, ``wait``, ``send_signal``, ``returncode``, the pipes);
    :meth:`stop` ends *every* process in the sandbox's cgroups and removes them.
    """

    def __init__(
        self,
        *,
        name: SandboxName,
        process: subprocess.Popen[bytes],
        cgroups: SandboxCgroups,
        mount_ns: int,
    ) -> None:
        """Internal: use :meth:`start`."""
        self._name = name
        self._process = process
        self._cgroups = cgroups
        self._mount_ns = mount_ns
        self._removed = False

    @classmethod
    def start(
        cls,
        spec: SandboxSpec,
        *,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        timeout: float = DEFAULT_START_TIMEOUT,
    ) -> Sandbox:
        """Create the cgroups, then start ``spec.argv`` inside them and a new mount namespace.

        Returns once the command has been executed (not when it is "ready" in any sense of
        its own). ``stdin``/``stdout``/``stderr`` are as for ``Popen`` (``subprocess.PIPE``,
        an fd, a file, or ``None`` to inherit). The command runs in its own session.
        Raises :class:`SandboxStartError` (or :class:`SandboxUnsupportedError`) after
        removing whatever it created.
        """
        backends = _resolve_backends(spec.backends)
        nodes = _control_nodes() if spec.nvidia_control_nodes else []
        rules = effective_rules(spec.rules, nodes)
        name = _new_name(spec.name_prefix)
        created: list[Path] = []
        try:
            sandbox_cgroups = _create_cgroups(backends, spec.cgroup_parent, name, rules, created)
            process, mount_ns = _spawn(spec, sandbox_cgroups, nodes, stdin, stdout, stderr, timeout)
        except BaseException as e:
            try:
                _remove_dirs(created)
            except SandboxStopError as cleanup_error:
                e.add_note(f"cleaning up also failed: {cleanup_error}")
            raise
        return cls(name=name, process=process, cgroups=sandbox_cgroups, mount_ns=mount_ns)

    @property
    def name(self) -> SandboxName:
        return self._name

    @property
    def pid(self) -> int:
        """The sandbox's outermost process, in the caller's pid namespace: it runs in the
        sandbox's cgroups and mount namespace, relays signals to the command and ends as the
        command does (exit status or signal). The command itself is pid 2 of the sandbox's
        own pid namespace (its init is pid 1); ``processes`` lists them all."""
        return self._process.pid

    @property
    def cgroups(self) -> SandboxCgroups:
        return self._cgroups

    @property
    def mount_ns(self) -> int:
        """Inode number of the sandbox's mount namespace (as in ``/proc/PID/ns/mnt``)."""
        return self._mount_ns

    @property
    def returncode(self) -> int | None:
        """As for ``Popen``: ``None`` while running, ``-N`` when killed by signal N."""
        return self._process.returncode

    @property
    def stdin(self) -> IO[bytes] | None:
        return self._process.stdin

    @property
    def stdout(self) -> IO[bytes] | None:
        return self._process.stdout

    @property
    def stderr(self) -> IO[bytes] | None:
        return self._process.stderr

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` has completed (processes gone, cgroups removed)."""
        return self._removed

    def poll(self) -> int | None:
        return self._process.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command (not its children) to exit; raises
        ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        return self._process.wait(timeout)

    def send_signal(self, sig: int) -> None:
        """Signal the command (relayed to its process group; a no-op once reaped)."""
        self._process.send_signal(sig)

    def processes(self) -> list[int]:
        """Every pid now in the sandbox's cgroups (the command and all its descendants)."""
        return _members(self._cgroups.dirs())

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT) -> int:
        """End every process in the sandbox and remove its cgroups; idempotent.

        SIGTERM to all, up to ``timeout`` seconds for them to exit, then SIGKILL. The
        device program goes with the cgroup2 directory and the mount namespace with its
        last process. Returns the command's exit status.
        """
        if self._removed:
            return self._process.wait()
        dirs = self._cgroups.dirs()
        _signal_members(dirs, signal.SIGTERM)
        if not _wait_gone(dirs, self._process, time.monotonic() + timeout):
            self._process.kill()
            if not _kill_until_gone(dirs, self._process, time.monotonic() + _KILL_GRACE):
                raise SandboxStopError(
                    f"sandbox {self._name}: processes {_members(dirs)} survive SIGKILL"
                )
        _remove_dirs(dirs)
        self._removed = True
        return self._process.wait()  # Already reaped: returns at once.

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._removed else f"returncode={self._process.returncode}"
        return f"<Sandbox {self._name} pid={self.pid} {state}>"


def cleanup_stale(
    prefix: str,
    *,
    cgroup_parent: str = DEFAULT_CGROUP_PARENT,
    include_live_owners: bool = False,
) -> tuple[SandboxName, ...]:
    """Remove sandboxes named ``prefix`` whose owner process is gone (a crashed run).

    Kills their processes and removes their cgroups in every hierarchy; returns the
    names removed. A sandbox whose owner (the process that started it, identified by pid
    and start time in this pid namespace) still runs is left alone unless
    ``include_live_owners``, so two servers sharing a prefix cannot kill each other's.
    """
    if _PREFIX.fullmatch(prefix) is None:
        raise ValueError(f"invalid name prefix {prefix!r}")
    pattern = re.compile(rf"{re.escape(prefix)}\.(?P<pid>\d+)-(?P<start>\d+)\.[0-9a-f]+")
    hierarchies = cgroups.discover()
    stale: dict[SandboxName, list[Path]] = {}
    for mount in (hierarchies.devices_v1, hierarchies.unified):
        if mount is None:
            continue
        parent = mount.mount_point / cgroup_parent
        with contextlib.suppress(FileNotFoundError):  # No sandbox ever made on this hierarchy.
            for entry in os.scandir(parent):
                match = pattern.fullmatch(entry.name)
                if match is None or not entry.is_dir(follow_symlinks=False):
                    continue
                owner_alive = _start_time(int(match["pid"])) == int(match["start"])
                if include_live_owners or not owner_alive:
                    stale.setdefault(SandboxName(entry.name), []).append(parent / entry.name)
    for dirs in stale.values():
        if not _kill_until_gone(dirs, None, time.monotonic() + _KILL_GRACE):
            raise SandboxStopError(f"processes {_members(dirs)} in {dirs} survive SIGKILL")
        _remove_dirs(dirs)
    return tuple(sorted(stale))


# ---- creating ----------------------------------------------------------------------------


def _resolve_backends(wanted: frozenset[Backend] | None) -> tuple[Backend, ...]:
    available = host_backends()
    chosen = available if wanted is None else wanted
    missing = chosen - available
    if missing or not chosen:
        names = ", ".join(sorted(b.value for b in missing)) or "any device cgroup"
        raise SandboxUnsupportedError(
            f"this host has no {names} hierarchy mounted (found: "
            f"{', '.join(sorted(b.value for b in available)) or 'none'})"
        )
    return tuple(b for b in Backend if b in chosen)


def _control_nodes() -> list[devnodes.DeviceNode]:
    try:
        return devnodes.nvidia_control_devices()
    except devnodes.DevNodeError as e:
        raise SandboxStartError(
            f"cannot list the host's NVIDIA control nodes: {e}", step="control-nodes"
        ) from e


def _new_name(prefix: str) -> SandboxName:
    pid = os.getpid()
    start = _start_time(pid)
    return SandboxName(f"{prefix}.{pid}-{start}.{secrets.token_hex(4)}")


def _start_time(pid: int) -> int | None:
    """A process's start time: with the pid, a unique identity (None once it is gone)."""
    who = procfs.identity(pid)
    return None if who is None else who.start_time


def _create_cgroups(
    backends: Sequence[Backend],
    parent: str,
    name: SandboxName,
    rules: Sequence[DeviceRule],
    created: list[Path],
) -> SandboxCgroups:
    """Make the sandbox's directories and give them ``rules``, appending each to ``created``
    as soon as it exists so the caller can remove it on any failure."""
    hierarchies = cgroups.discover()
    dirs: dict[Backend, Path] = {}
    program: cgroup_v2.ProgId | None = None
    for backend in backends:
        mount = hierarchies.devices_v1 if backend is Backend.V1 else hierarchies.unified
        assert mount is not None  # _resolve_backends checked that it is mounted
        directory = mount.mount_point / parent / name
        step = f"cgroup-{backend.value}"
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir()
            created.append(directory)
            if backend is Backend.V1:
                cgroup_v1.set_policy(directory, rules)
            else:
                program = cgroup_v2.attach_device_program(directory, rules, default_allow=False)
        except (OSError, cgroup_v1.CgroupV1Error, cgroup_v2.CgroupV2Error) as e:
            raise SandboxStartError(
                f"cannot set up the {backend.value} device cgroup {directory}: {e}",
                step=step,
                errno_=e.errno if isinstance(e, OSError) else None,
            ) from e
        dirs[backend] = directory
    return SandboxCgroups(v1=dirs.get(Backend.V1), v2=dirs.get(Backend.V2), v2_program=program)


def _bootstrap_config(
    spec: SandboxSpec,
    sandbox_cgroups: SandboxCgroups,
    nodes: Sequence[devnodes.DeviceNode],
    *,
    pid: int,
) -> bytes:
    dropping = spec.uid is not None or spec.gid is not None
    groups = spec.groups if spec.groups is not None else (() if dropping else None)
    env = {**(os.environ if spec.env is None else spec.env), SANDBOX_PID_ENV: str(pid)}
    config = {
        "argv": list(spec.argv),
        "env": env,
        "cwd": spec.cwd,
        "cgroup_procs": [str(d / "cgroup.procs") for d in sandbox_cgroups.dirs()],
        "extra_nodes": [
            {"name": n.name, "major": n.device.major, "minor": n.device.minor, "mode": n.mode}
            for n in nodes
        ],
        "uid": spec.uid,
        "gid": spec.gid,
        "groups": None if groups is None else list(groups),
        "capabilities": None if spec.capabilities is None else sorted(spec.capabilities),
        "read_only": spec.read_only,
        "writable": [*_writable(spec, env), *spec.writable],
        "hidden": list(spec.hidden),
        "end_with_owner": spec.end_with_owner,
    }
    return json.dumps(config).encode()


def _writable(spec: SandboxSpec, env: Mapping[str, str]) -> list[str]:
    """What a workload writes to by default: its working directory, home and temp dirs."""
    home = env.get("HOME")
    return [spec.cwd or os.getcwd(), *_ALWAYS_WRITABLE, *([home] if home else [])]


def _spawn(
    spec: SandboxSpec,
    sandbox_cgroups: SandboxCgroups,
    nodes: Sequence[devnodes.DeviceNode],
    stdin: int | IO[Any] | None,
    stdout: int | IO[Any] | None,
    stderr: int | IO[Any] | None,
    timeout: float,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start the bootstrap, hand it its configuration and wait until it has exec'd."""
    deadline = time.monotonic() + timeout
    cfg_r, cfg_w = os.pipe()
    status_r, status_w = os.pipe()
    try:
        try:
            # -I -S: the bootstrap is stdlib-only; ignore PYTHON* variables and site-packages
            # so neither the caller's environment nor a broken venv can change it.
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_INIT_SCRIPT), str(cfg_r), str(status_w)],
                pass_fds=(cfg_r, status_w),
                env={},
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        except OSError as e:
            raise SandboxStartError(
                f"cannot start the sandbox bootstrap {sys.executable}: {e}",
                step="spawn",
                errno_=e.errno,
            ) from e
        finally:
            os.close(cfg_r)
            os.close(status_w)
        try:
            config = _bootstrap_config(spec, sandbox_cgroups, nodes, pid=process.pid)
            _write_all(cfg_w, config, deadline)
            os.close(cfg_w)
            cfg_w = -1
            status = _read_to_eof(status_r, deadline)
            return process, _parse_status(status, process)
        except BaseException:
            _abandon(process)
            raise
    finally:
        if cfg_w >= 0:
            os.close(cfg_w)
        os.close(status_r)


def _parse_status(status: bytes, process: subprocess.Popen[bytes]) -> int:
    """The mount namespace inode from ``R<inode>``, or the bootstrap's error raised."""
    ready, _, error = status.partition(_init.ERROR)
    if error:
        try:
            report = json.loads(error)
            message, step, err = str(report["message"]), str(report["step"]), report["errno"]
        except (ValueError, KeyError, TypeError) as e:
            raise SandboxStartError(f"garbled bootstrap report {error!r}", step="internal") from e
        raise SandboxStartError(f"sandbox setup failed at {step}: {message}", step=step, errno_=err)
    if not ready.startswith(_init.READY):
        code = process.wait()
        raise SandboxStartError(
            f"the sandbox bootstrap exited with status {code} before the sandbox was ready "
            "(its stderr says why)",
            step="bootstrap",
        )
    return int(ready[len(_init.READY) :])


def _abandon(process: subprocess.Popen[bytes]) -> None:
    """Kill and reap a bootstrap that failed or timed out (it may have joined the cgroups,
    which the caller then removes: they must be empty), and close the caller's pipes to it:
    nobody else holds the ``Popen`` that owns them."""
    if process.poll() is None:
        process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


def _write_all(fd: int, data: bytes, deadline: float) -> None:
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        _wait_fd(fd, select.POLLOUT, deadline)
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue
        except BrokenPipeError as e:
            raise SandboxStartError(
                "the sandbox bootstrap exited before reading its configuration", step="bootstrap"
            ) from e


def _read_to_eof(fd: int, deadline: float) -> bytes:
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    while True:
        _wait_fd(fd, select.POLLIN, deadline)
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _wait_fd(fd: int, events: int, deadline: float) -> None:
    poller = select.poll()
    poller.register(fd, events)
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not poller.poll(remaining * 1000):
        raise SandboxStartError("the sandbox bootstrap did not finish in time", step="timeout")


# ---- stopping ----------------------------------------------------------------------------


def _members(dirs: Iterable[Path]) -> list[int]:
    pids: set[int] = set()
    for directory in dirs:
        with contextlib.suppress(FileNotFoundError):  # Already removed: holds nobody.
            pids.update(int(p) for p in (directory / "cgroup.procs").read_text().split())
    return sorted(pids)


def _signal_members(dirs: Sequence[Path], sig: signal.Signals) -> None:
    """Signal every process in ``dirs`` without ever hitting a recycled pid.

    A pid read from ``cgroup.procs`` can exit and be reused before we signal it. Pinning
    the process with a pidfd and then seeing the pid still listed proves the pidfd is a
    member: a process that died since would make the signal fail with ESRCH instead.
    """
    for pid in _members(dirs):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # Exited since we listed it: nothing to signal.
        except OSError as e:
            # EINVAL: a thread-group leader that has exited while its other threads still
            # run (kernels before 6.9 refuse to pin it). The callers signal again until the
            # cgroup is empty, so the next round reaches what is left of it.
            if e.errno != errno.EINVAL:
                raise
            continue
        try:
            if pid in _members(dirs):
                with contextlib.suppress(ProcessLookupError):  # Exited meanwhile: fine.
                    signal.pidfd_send_signal(pidfd, sig)
        finally:
            os.close(pidfd)


def _kill_until_gone(
    dirs: Sequence[Path], process: subprocess.Popen[bytes] | None, deadline: float
) -> bool:
    """SIGKILL everything in ``dirs`` until they are empty; ``False`` at ``deadline``.

    ``cgroup.kill`` (cgroup2, Linux 5.14) kills a whole cgroup atomically, forks in flight
    included; on v1 a process can fork between our listing and our signal, so the round
    repeats until nothing is left.
    """
    while True:
        for directory in dirs:
            kill_file = directory / "cgroup.kill"
            if kill_file.exists():  # Not on v1, nor before Linux 5.14.
                kill_file.write_text("1")
        _signal_members(dirs, signal.SIGKILL)
        if _wait_gone(dirs, process, min(deadline, time.monotonic() + _KILL_ROUND)):
            return True
        if time.monotonic() >= deadline:
            return False


def _wait_gone(
    dirs: Sequence[Path], process: subprocess.Popen[bytes] | None, deadline: float
) -> bool:
    """Poll until ``process`` is reaped and ``dirs`` are empty; ``False`` at ``deadline``.

    The kernel offers no single notification for "this v1 cgroup is empty", so this
    polls with a short, growing interval.
    """
    interval = _POLL_MIN
    while True:
        reaped = process is None or process.poll() is not None
        if reaped and not _members(dirs):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
        interval = min(interval * 2, _POLL_MAX)


def _remove_dirs(dirs: Iterable[Path]) -> None:
    """Remove empty sandbox cgroups. A just-exited process can keep a cgroup busy for a
    moment after it left ``cgroup.procs``, so EBUSY is retried briefly."""
    for directory in dirs:
        deadline = time.monotonic() + _KILL_GRACE
        interval = _POLL_MIN
        while True:
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                    raise SandboxStopError(f"cannot remove cgroup {directory}: {e}") from e
            time.sleep(interval)
            interval = min(interval * 2, _POLL_MAX)
