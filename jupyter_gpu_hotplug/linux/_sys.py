"""The few Linux syscalls Python 3.11's ``os`` module lacks, as thin typed functions.

Why this module exists: the mechanics must resolve paths the way the kernel
confines them — inside a hostile container's root (``RESOLVE_IN_ROOT``), never
through a symlink (``RESOLVE_NO_SYMLINKS``), never onto another filesystem
(``RESOLVE_NO_XDEV``) — and must know which filesystem a file lives on
(``fstatfs``). ``openat2(2)`` (Linux 5.6) and ``f_type`` are not in ``os``; this
is the one place that reaches them through ctypes, so no other module touches
libc directly. Nothing here knows about cgroups, devices or containers.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Final

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# openat2 has the same number on every architecture: it was added after the
# syscall tables were unified (Linux 5.6, commit fddb5d430ad9).
_SYS_OPENAT2: Final = 437

RESOLVE_NO_XDEV: Final = 0x01
"""Fail with EXDEV when resolution would cross a mount point."""
RESOLVE_NO_MAGICLINKS: Final = 0x02
"""Fail with ELOOP on ``/proc/<pid>/fd``-style magic links."""
RESOLVE_NO_SYMLINKS: Final = 0x04
"""Fail with ELOOP on any symlink (implies ``RESOLVE_NO_MAGICLINKS``)."""
RESOLVE_BENEATH: Final = 0x08
"""Fail with EXDEV when resolution would leave the directory given as ``dirfd``."""
RESOLVE_IN_ROOT: Final = 0x10
"""Treat ``dirfd`` as ``/``: absolute symlinks and ``..`` cannot leave it."""

CGROUP_SUPER_MAGIC: Final = 0x0027E0EB
"""``f_type`` of a cgroup v1 hierarchy (include/uapi/linux/magic.h)."""
CGROUP2_SUPER_MAGIC: Final = 0x63677270
"""``f_type`` of the cgroup v2 (unified) hierarchy."""
PROC_SUPER_MAGIC: Final = 0x9FA0
"""``f_type`` of a procfs."""
SYSFS_MAGIC: Final = 0x62656572
"""``f_type`` of a sysfs."""
TMPFS_MAGIC: Final = 0x01021994
"""``f_type`` of a tmpfs (a container's private ``/dev``; also the host's devtmpfs)."""

# With RESOLVE_BENEATH/RESOLVE_IN_ROOT the kernel answers EAGAIN when a concurrent
# rename could have let ".." escape; openat2(2) says the caller may retry.
_OPENAT2_ATTEMPTS: Final = 8

# struct statfs is 120 bytes on 64-bit Linux; f_type (a long) comes first on every
# architecture. A larger buffer keeps 32-bit layouts safe too.
_STATFS_SIZE: Final = 256


def openat2(dirfd: int, path: str, flags: int, *, resolve: int, mode: int = 0) -> int:
    """Open ``path`` relative to ``dirfd`` under the ``resolve`` restrictions.

    ``O_CLOEXEC`` is always added: no fd of ours may leak into a child the agent
    starts. Raises ``OSError`` with the kernel's errno and ``path`` as filename.
    """
    how = struct.pack("=QQQ", flags | os.O_CLOEXEC, mode, resolve)
    buffer = ctypes.create_string_buffer(how, len(how))
    err = 0
    for _ in range(_OPENAT2_ATTEMPTS):
        fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), buffer, len(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):
            break
    raise OSError(err, f"openat2: {os.strerror(err)}", path)


def fs_type(fd: int) -> int:
    """The filesystem magic number (``statfs.f_type``) of the file behind ``fd``.

    Works on ``O_PATH`` descriptors (Linux 3.12), so a directory can be checked
    without being opened for reading.
    """
    buffer = ctypes.create_string_buffer(_STATFS_SIZE)
    if _libc.fstatfs(fd, buffer) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fstatfs: {os.strerror(err)}")
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def fd_path(fd: int) -> str:
    """The ``/proc/self/fd`` magic link naming exactly the inode behind ``fd``.

    ``fchmod``/``fchown`` refuse ``O_PATH`` descriptors (EBADF), and opening a
    device node for real would run its driver's open; ``chmod`` on this path
    changes the very inode the fd pins, whatever has since been renamed or
    replaced under the original name.
    """
    return f"/proc/self/fd/{fd}"
