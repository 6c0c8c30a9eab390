"""In-sandbox bootstrap: build the private mount namespace and ``/dev``, join the cgroups, exec.

Boundary: this file runs as its own short-lived process, started by
:mod:`jupyter_gpu_hotplug.linux.sandbox` as ``python -I -S _sandbox_init.py CFG_FD STATUS_FD``
and replaced (``execve``) by the sandboxed command once the sandbox is in place. It is
stdlib-only and imports nothing from this package, so it starts fast and works with ``-S``.

Why a separate process that execs instead of a ``preexec_fn`` or a fork of the caller: the
caller is usually a multi-threaded server (jupyter_server, the agent), where running Python
between ``fork`` and ``exec`` can deadlock, and ``unshare(CLONE_NEWNS)`` must happen in a
single-threaded process. Doing every step here, in the process that becomes the workload,
makes the start race-free: the command's first instruction already runs inside the mount
namespace and inside every cgroup, because the ``execve`` comes last.

Protocol with the parent (both fds inherited, numbers on the command line):

* ``CFG_FD``: the parent writes one JSON document (the fields of :class:`_Config`) and closes
  it. Passing it on a pipe rather than argv keeps the workload's environment (tokens!) out of
  ``/proc/PID/cmdline``.
* ``STATUS_FD``: we write ``R`` and the mount namespace's inode number (decimal) once the
  sandbox is set up, then set close-on-exec and exec; the
  parent sees end-of-file when the exec succeeded. On any failure we write ``E`` followed by a
  JSON object ``{"step", "errno", "message"}`` and exit with status 127.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import stat
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

# Flags from <sys/mount.h> and <sched.h>; stable kernel ABI.
CLONE_NEWNS = 0x00020000
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_STRICTATIME = 1 << 24
MNT_DETACH = 0x2

READY = b"R"
ERROR = b"E"
EXIT_SETUP_FAILED = 127

#: Size of the private ``/dev`` tmpfs: it only holds device nodes and symlinks (runc's value).
DEV_TMPFS_OPTIONS = "mode=755,size=65536k"
#: ``/dev/pts``: a fresh devpts instance, so the sandbox sees only its own ptys (runc's options).
DEVPTS_OPTIONS = "newinstance,ptmxmode=0666,mode=0620,gid=5"
#: ``/dev/shm``: no size cap beyond tmpfs's default (half of RAM). Docker's 64 MiB cap is a
#: well-known cause of crashing PyTorch DataLoader workers, which notebook users run.
SHM_OPTIONS = "mode=1777"

#: The device nodes every container gets (OCI runtime spec, "Default Devices").
BASIC_NODES: tuple[tuple[str, int, int], ...] = (
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
)
SYMLINKS: tuple[tuple[str, str], ...] = (
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("ptmx", "pts/ptmx"),
)


class SetupError(Exception):
    """A failed bootstrap step; reported to the parent as ``{"step", "errno", "message"}``."""

    def __init__(self, step: str, message: str, errno_: int | None = None) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message
        self.errno = errno_


@dataclass(frozen=True)
class _Node:
    name: str
    major: int
    minor: int
    mode: int


@dataclass(frozen=True)
class _Config:
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    cgroup_procs: list[str]
    extra_nodes: list[_Node]
    uid: int | None
    gid: int | None
    groups: list[int] | None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> _Config:
        return cls(
            argv=[str(a) for a in raw["argv"]],
            env={str(k): str(v) for k, v in raw["env"].items()},
            cwd=raw["cwd"],
            cgroup_procs=[str(p) for p in raw["cgroup_procs"]],
            extra_nodes=[_Node(**node) for node in raw["extra_nodes"]],
            uid=raw["uid"],
            gid=raw["gid"],
            groups=raw["groups"],
        )


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, step: str, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(step, f"{what}: {os.strerror(err)}", err)


def _mount(
    step: str, source: str, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        step,
        f"mount {fstype or source} on {target} ({data or ''})",
    )


def _private_mount_namespace() -> None:
    _check(_libc.unshare(CLONE_NEWNS), "unshare", "unshare(CLONE_NEWNS)")
    # Without this, our mounts would propagate back to the host through shared peer groups
    # (systemd makes / shared). Like runc's rootfsPropagation "rprivate".
    _mount("propagation", "none", "/", None, MS_REC | MS_PRIVATE, None)


def _detach_host_dev() -> None:
    """Lazily unmount the host's /dev and everything below it (pts, shm, mqueue, ...).

    Mounting over /dev would only shadow them; detaching makes the sandbox's mount table
    hold nothing of the host's /dev, so unmounting our tmpfs cannot reveal the host nodes.
    """
    if _libc.umount2(b"/dev", MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # /dev is a plain directory on this host: nothing to detach.
            raise SetupError("detach-dev", f"umount /dev: {os.strerror(err)}", err)


def _mknod(name: str, major: int, minor: int, mode: int) -> None:
    path = f"/dev/{name}"
    try:
        os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
        os.chmod(path, mode)  # mknod is subject to the umask, which we pass on untouched.
    except OSError as e:
        raise SetupError("mknod", f"{path} (c {major}:{minor}): {e.strerror}", e.errno) from e


def _populate_dev(extra_nodes: list[_Node]) -> None:
    _mount("mount-dev", "tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_STRICTATIME, DEV_TMPFS_OPTIONS)
    for name, major, minor in BASIC_NODES:
        _mknod(name, major, minor, 0o666)
    for node in extra_nodes:
        _mknod(node.name, node.major, node.minor, node.mode)
    try:
        for name, target in SYMLINKS:
            os.symlink(target, f"/dev/{name}")
        os.mkdir("/dev/pts", 0o755)
        os.mkdir("/dev/shm", 0o1777)
    except OSError as e:
        raise SetupError("populate-dev", f"{e.filename}: {e.strerror}", e.errno) from e
    _mount("mount-devpts", "devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, DEVPTS_OPTIONS)
    _mount("mount-shm", "shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, SHM_OPTIONS)


def _join_cgroups(procs_files: list[str]) -> None:
    pid = str(os.getpid())
    for path in procs_files:
        try:
            with open(path, "w") as f:
                f.write(pid)
        except OSError as e:
            raise SetupError("join-cgroup", f"write {pid} to {path}: {e.strerror}", e.errno) from e


def _drop_privileges(cfg: _Config) -> None:
    try:
        if cfg.groups is not None:
            os.setgroups(cfg.groups)
        if cfg.gid is not None:
            os.setgid(cfg.gid)
        if cfg.uid is not None:
            os.setuid(cfg.uid)
    except OSError as e:
        raise SetupError(
            "credentials", f"uid={cfg.uid} gid={cfg.gid}: {e.strerror}", e.errno
        ) from e


def _read_config(fd: int) -> _Config:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    try:
        return _Config.from_json(json.loads(b"".join(chunks)))
    except (ValueError, KeyError, TypeError) as e:
        raise SetupError("config", f"invalid sandbox configuration: {e}") from e


def _exec(cfg: _Config, status_fd: int, mount_ns: int) -> NoReturn:
    if cfg.cwd is not None:
        try:
            os.chdir(cfg.cwd)
        except OSError as e:
            raise SetupError("chdir", f"{cfg.cwd}: {e.strerror}", e.errno) from e
    # The interpreter ignores these at start-up and SIG_IGN survives execve: give the
    # workload the default dispositions, as subprocess's restore_signals does.
    for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    os.write(status_fd, READY + str(mount_ns).encode())
    os.set_inheritable(status_fd, False)
    try:
        os.execvpe(cfg.argv[0], cfg.argv, cfg.env)
    except OSError as e:
        raise SetupError("exec", f"cannot execute {cfg.argv[0]!r}: {e.strerror}", e.errno) from e


def main(argv: list[str]) -> NoReturn:
    cfg_fd, status_fd = int(argv[1]), int(argv[2])
    try:
        cfg = _read_config(cfg_fd)
        _private_mount_namespace()
        mount_ns = os.stat("/proc/self/ns/mnt").st_ino
        _detach_host_dev()
        _populate_dev(cfg.extra_nodes)
        # Join only now: creating /dev's nodes must not depend on the policy granting
        # mknod, and everything from here on (the exec above all) runs confined.
        _join_cgroups(cfg.cgroup_procs)
        _drop_privileges(cfg)
        _exec(cfg, status_fd, mount_ns)
    except SetupError as e:
        _report(status_fd, {"step": e.step, "errno": e.errno, "message": e.message})
    except Exception as e:  # Anything unforeseen must still reach the parent as an error.
        _report(status_fd, {"step": "internal", "errno": None, "message": repr(e)})


def _report(status_fd: int, report: dict[str, Any]) -> NoReturn:
    os.write(status_fd, ERROR + json.dumps(report).encode())
    os._exit(EXIT_SETUP_FAILED)


if __name__ == "__main__":
    main(sys.argv)
