"""Bind mounts of host files into a running container's mount namespace, and their removal.

Why this module exists: a hot-attached GPU is useless without the driver's user-space libraries
(``libcuda.so.1``, ``libnvidia-ml.so.1``) and tools in the container; a container started without
a GPU has none of them. A runtime mounts them at creation; for a running container the agent has
to do it, from outside, and safely.

How: the mount point is found or made inside the container's root with ``openat2``: its
directories under ``RESOLVE_IN_ROOT`` (a link the image has, ``/var/run -> /run`` in Debian's,
is followed as a runtime follows it — never out of the container's root, never through a
``/proc`` magic link, never onto a procfs or sysfs), the mount point itself never through a link
(``RESOLVE_NO_SYMLINKS`` below its directory). The source is opened
under ``source_root``, the host's root as the agent sees it (``/``; an agent in a pod mounts the
host's at ``/host``), and the mount is made by :mod:`._mount_helper`, a single-threaded child
that clones the source with ``open_tree`` in the agent's mount namespace and attaches the clone
with ``move_mount`` in the container's —
given only file descriptors. Whether a mount is there is decided by the kernel's answer, never
by a name: the target shows the source's very inode (device and inode numbers) or it does not.

Bounds: a mount point that is missing is created (parents ``0755``, files ``0644``, as runtimes
create them) and reported, so the caller can remove it again; a target that is a symlink or of
the wrong type, or a root filesystem that is read-only and lacks the mount point, is refused
with :class:`MountError` and nothing is changed.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from . import procfs
from ._sys import (
    PROC_SUPER_MAGIC,
    RESOLVE_BENEATH,
    RESOLVE_IN_ROOT,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    SYSFS_MAGIC,
    fs_type,
    openat2,
)

__all__ = [
    "BindMount",
    "MadeMount",
    "MountError",
    "UnsafeMountTargetError",
    "bind",
    "is_bound",
    "unbind",
]

MOUNT_ATTR_RDONLY: Final = 0x1
MOUNT_ATTR_NOSUID: Final = 0x2
MOUNT_ATTR_NODEV: Final = 0x4
MOUNT_ATTR_NOEXEC: Final = 0x8
_ATTRS: Final = {
    "ro": MOUNT_ATTR_RDONLY,
    "nosuid": MOUNT_ATTR_NOSUID,
    "nodev": MOUNT_ATTR_NODEV,
    "noexec": MOUNT_ATTR_NOEXEC,
}
HELPER: Final = Path(__file__).with_name("_mount_helper.py")
HELPER_TIMEOUT: Final = 30.0
"""The helper makes a handful of syscalls; the bound only catches a wedged kernel call."""
_DIR_MODE: Final = 0o755
_FILE_MODE: Final = 0o644
DIRECTORIES: Final = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
"""How a mount point's directories are resolved in a container: links followed, in its root."""
_KERNEL_FILESYSTEMS: Final = frozenset({PROC_SUPER_MAGIC, SYSFS_MAGIC})
ROOT: Final = Path("/")
_BELOW: Final = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS


class MountError(Exception):
    """A mount could not be made, checked or removed; what was done before it is reported by
    the caller's rollback, nothing half-made is left by this module."""


class UnsafeMountTargetError(MountError):
    """Something other than a plain file or directory of the source's type sits at (or on the
    way to) the mount point: a symlink, a device, a file where a directory is needed."""


@dataclass(frozen=True)
class BindMount:
    """``source`` (absolute, in the source's root) bind-mounted at ``target`` (absolute, in
    the container's root) with the mount attributes ``options`` names (``ro``, ``nosuid``,
    ``nodev``, ``noexec``; ``rbind`` clones the source's submounts too)."""

    source: PurePosixPath
    target: PurePosixPath
    options: tuple[str, ...] = ("ro", "nosuid", "nodev")

    @property
    def attrs(self) -> int:
        flags = 0
        for option in self.options:
            flags |= _ATTRS.get(option, 0)
        return flags


@dataclass(frozen=True)
class MadeMount:
    """A mount :func:`bind` made, and the mount-point entries it had to create (deepest
    last), which are the caller's to remove after :func:`unbind`."""

    mount: BindMount
    created: tuple[PurePosixPath, ...]


def bind(
    pid: int, mounts: Sequence[BindMount], *, source_root: Path = ROOT, proc: Path = procfs.PROC
) -> list[MadeMount]:
    """Bind-mount each of ``mounts`` into the mount namespace of ``pid``; those already there
    (the target shows the source's inode) are skipped and not returned.

    All or nothing: when a step fails, the mounts this call made are removed and the entries
    it created deleted before :class:`MountError` is raised.
    """
    made: list[MadeMount] = []
    try:
        with ExitStack() as fds:
            root = _root_fd(pid, proc, fds)
            source_root_fd = _open_dir(source_root, fds)
            ops: list[dict[str, int | str]] = []
            for mount in mounts:
                source = fds.enter_context(_opened(source_root_fd, mount.source, _source=True))
                source_stat = os.fstat(source)
                target, created = _mount_point(root, mount.target, source_stat, fds)
                if target is None:
                    continue
                made.append(MadeMount(mount, created))
                ops.append({"op": "bind", "source": source, "target": target, "attrs": mount.attrs})
            if ops:
                _run_helper(pid, proc, ops, fds)
    except BaseException:
        _undo(pid, made, source_root=source_root, proc=proc)
        raise
    return made


def unbind(
    pid: int, mounts: Sequence[BindMount], *, source_root: Path = ROOT, proc: Path = procfs.PROC
) -> list[BindMount]:
    """Remove the bind mounts of ``mounts`` that are there (the target shows the source's
    inode), topmost only; the others are left alone. Returns those removed."""
    removed: list[BindMount] = []
    with ExitStack() as fds:
        root = _root_fd(pid, proc, fds)
        source_root_fd = _open_dir(source_root, fds)
        ops: list[dict[str, int | str]] = []
        for mount in mounts:
            target = _bound_target(root, source_root_fd, mount, fds)
            if target is not None:
                ops.append({"op": "unmount", "target": target})
                removed.append(mount)
        if ops:
            _run_helper(pid, proc, ops, fds)
    return removed


def is_bound(
    pid: int, mount: BindMount, *, source_root: Path = ROOT, proc: Path = procfs.PROC
) -> bool:
    """Whether ``mount.target`` in the container shows ``mount.source``'s very inode."""
    with ExitStack() as fds:
        root = _root_fd(pid, proc, fds)
        source_root_fd = _open_dir(source_root, fds)
        return _bound_target(root, source_root_fd, mount, fds) is not None


def remove_created(pid: int, entries: Sequence[PurePosixPath], *, proc: Path = procfs.PROC) -> None:
    """Delete mount-point entries :func:`bind` created, deepest first, each only while it is
    still an empty regular file or an empty directory (never what the container put there
    since, and never a mount point still in use: that is EBUSY and left)."""
    with ExitStack() as fds:
        root = _root_fd(pid, proc, fds)
        for entry in reversed(entries):
            # Anything unexpected on the way (gone, a link, not a directory) means the entry
            # is no longer the one made: it is left alone.
            with suppress(MountError, OSError):
                parent = fds.enter_context(_opened(root, entry.parent, directory=True))
                info = os.stat(entry.name, dir_fd=parent, follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    os.rmdir(entry.name, dir_fd=parent)  # ENOTEMPTY, EBUSY: not ours to take
                elif stat.S_ISREG(info.st_mode) and info.st_size == 0:
                    os.unlink(entry.name, dir_fd=parent)


def _undo(pid: int, made: Sequence[MadeMount], *, source_root: Path, proc: Path) -> None:
    with suppress(MountError, OSError):
        unbind(pid, [m.mount for m in made], source_root=source_root, proc=proc)
    with suppress(MountError, OSError):
        remove_created(pid, [e for m in made for e in m.created], proc=proc)


def _open_dir(path: Path, fds: ExitStack) -> int:
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    fds.callback(os.close, fd)
    return fd


def _root_fd(pid: int, proc: Path, fds: ExitStack) -> int:
    try:
        fd = os.open(proc / str(pid) / "root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise MountError(f"process {pid} is gone") from e
    fds.callback(os.close, fd)
    return fd


@contextmanager
def _opened(
    root: int, path: PurePosixPath, *, directory: bool = False, _source: bool = False
) -> Iterator[int]:
    """An ``O_PATH`` fd of ``path`` under ``root``: a container's directory (links followed in
    its root), or a source (the host's driver files, written by root; links followed in the
    host's root)."""
    flags = os.O_PATH | (os.O_DIRECTORY if directory else 0)
    resolve = RESOLVE_IN_ROOT if _source else DIRECTORIES
    try:
        fd = openat2(root, str(path), flags, resolve=resolve)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise
        if e.errno == errno.ELOOP:
            raise UnsafeMountTargetError(f"{path} is, or passes through, a symlink") from e
        raise MountError(f"opening {path}: {e.strerror}") from e
    try:
        yield fd
    finally:
        os.close(fd)


def _mount_point(
    root: int, target: PurePosixPath, source: os.stat_result, fds: ExitStack
) -> tuple[int | None, tuple[PurePosixPath, ...]]:
    """An ``O_PATH`` fd of the mount point (made if missing), and the entries made for it;
    ``None`` when the source is already mounted there."""
    created: list[PurePosixPath] = []
    parent = _directory(root, target.parent, created, fds)
    want_dir = stat.S_ISDIR(source.st_mode)
    try:
        info = os.stat(target.name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        _create(parent, target, want_dir=want_dir)
        created.append(target)
    else:
        if (info.st_dev, info.st_ino) == (source.st_dev, source.st_ino):
            return None, ()
        if stat.S_ISLNK(info.st_mode):
            raise UnsafeMountTargetError(f"{target} in the container is a symlink")
        if stat.S_ISDIR(info.st_mode) != want_dir or not (
            stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)
        ):
            raise UnsafeMountTargetError(
                f"{target} in the container is not a {'directory' if want_dir else 'file'}"
            )
    fd = openat2(parent, target.name, os.O_PATH, resolve=_BELOW)
    fds.callback(os.close, fd)
    return fd, tuple(created)


def _directory(root: int, path: PurePosixPath, created: list[PurePosixPath], fds: ExitStack) -> int:
    """An fd of directory ``path`` in the container (links followed in its root), making the
    missing ones (``0755``) below the last that exists; never a procfs or sysfs one."""
    fd = os.dup(root)
    fds.callback(os.close, fd)
    here = PurePosixPath("/")
    for part in path.parts[1:]:
        here /= part
        try:
            child = openat2(root, str(here), os.O_PATH | os.O_DIRECTORY, resolve=DIRECTORIES)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafeMountTargetError(f"{here} in the container is a link loop") from e
            if e.errno == errno.ENOTDIR:
                raise UnsafeMountTargetError(f"{here} in the container is not a directory") from e
            if e.errno != errno.ENOENT:
                raise MountError(f"opening {here} in the container: {e.strerror}") from e
            _create(fd, here, want_dir=True)
            created.append(here)
            child = openat2(fd, part, os.O_PATH | os.O_DIRECTORY, resolve=_BELOW)
        fds.callback(os.close, child)
        fd = child
    if fs_type(fd) in _KERNEL_FILESYSTEMS:
        raise UnsafeMountTargetError(f"{path} in the container is on a procfs or sysfs")
    return fd


def _create(parent: int, path: PurePosixPath, *, want_dir: bool) -> None:
    """Make the mount point ``path`` (a directory or an empty file) under ``parent``, never
    replacing anything (``O_EXCL``)."""
    try:
        if want_dir:
            os.mkdir(path.name, _DIR_MODE, dir_fd=parent)
        else:
            # O_PATH fds cannot be openat()-ed through by the os module's dir_fd on creation
            # with O_EXCL semantics under our resolve rules; openat2 can.
            fd = openat2(
                parent,
                path.name,
                os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW,
                resolve=_BELOW,
                mode=_FILE_MODE,
            )
            os.close(fd)
    except OSError as e:
        if e.errno == errno.EROFS:
            raise MountError(
                f"the container's root filesystem is read-only and has no {path} to mount on"
            ) from e
        raise MountError(f"making the mount point {path} in the container: {e.strerror}") from e


def _bound_target(root: int, source_root: int, mount: BindMount, fds: ExitStack) -> int | None:
    """An ``O_PATH`` fd of ``mount.target`` when it shows the source's inode, else ``None``."""
    try:
        source = fds.enter_context(_opened(source_root, mount.source, _source=True))
        parent = fds.enter_context(_opened(root, mount.target.parent, directory=True))
        target = openat2(parent, mount.target.name, os.O_PATH, resolve=_BELOW)
    except FileNotFoundError:
        return None
    except UnsafeMountTargetError:
        return None  # a loop on the way: no mount of ours can be behind it
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return None  # a link or a file on the way: no mount of ours can be behind it
        raise MountError(f"opening {mount.target} in the container: {e.strerror}") from e
    fds.callback(os.close, target)
    ours, there = os.fstat(source), os.fstat(target)
    return target if (ours.st_dev, ours.st_ino) == (there.st_dev, there.st_ino) else None


def _run_helper(pid: int, proc: Path, ops: list[dict[str, int | str]], fds: ExitStack) -> None:
    try:
        namespace = os.open(proc / str(pid) / "ns" / "mnt", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise MountError(f"process {pid} is gone") from e
    fds.callback(os.close, namespace)
    request = {"target_ns": namespace, "ops": ops}
    passed = sorted(
        {namespace, *(int(v) for op in ops for k, v in op.items() if k in ("source", "target"))}
    )
    try:
        result = subprocess.run(
            [sys.executable, "-I", "-S", str(HELPER), json.dumps(request)],
            pass_fds=passed,
            capture_output=True,
            text=True,
            timeout=HELPER_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise MountError(f"the mount helper did not finish in {HELPER_TIMEOUT:g} s") from e
    try:
        answer = json.loads(result.stdout)
    except ValueError as e:
        raise MountError(
            f"the mount helper failed (exit {result.returncode}): {result.stderr[-2000:]}"
        ) from e
    if "error" in answer:
        raise MountError(f"{answer['error']} (after {answer['done']} of {len(ops)} steps)")
