"""The raw ``bpf(2)`` commands that cgroup device control needs, over ctypes.

Boundary: one function per command (load, attach, detach, query, get-fd-by-id,
get-info), each filling a ``ctypes.Structure`` that mirrors only the prefix of
``union bpf_attr`` that command reads. Policy and instruction layout live in
:mod:`.asm`; deciding *what* to attach lives in
:mod:`jupyter_gpu_hotplug.linux.cgroup_v2`.

Why it exists: Python has no binding for ``bpf(2)``, and the same defensive
habits that container runtimes settled on (opencontainers/cgroups
``ebpf_linux.go``) belong in one place: a bounded retry of ``EAGAIN`` on load,
the verifier log in the exception, every file descriptor closed on every path,
and optional kernel features probed once.

Every function raises :class:`BpfError` (an :class:`OSError` carrying the
kernel's errno) and never returns a bare descriptor: programs come back as
:class:`Fd`, which closes exactly once.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import functools
import os
import platform
import re
from dataclasses import dataclass
from types import TracebackType
from typing import NewType

ProgId = NewType("ProgId", int)
"""A kernel-wide BPF program id (stable while the program is loaded)."""


class Command(enum.IntEnum):
    """``enum bpf_cmd`` values used here (include/uapi/linux/bpf.h)."""

    PROG_LOAD = 5
    PROG_ATTACH = 8
    PROG_DETACH = 9
    PROG_GET_FD_BY_ID = 13
    OBJ_GET_INFO_BY_FD = 15
    PROG_QUERY = 16


PROG_TYPE_CGROUP_DEVICE = 15
"""``BPF_PROG_TYPE_CGROUP_DEVICE`` (Linux 4.15)."""

ATTACH_CGROUP_DEVICE = 6
"""``BPF_CGROUP_DEVICE``, the attach type of device programs."""


class AttachFlags(enum.IntFlag):
    """``BPF_F_*`` flags of ``BPF_PROG_ATTACH``; ``NONE`` is the exclusive mode."""

    NONE = 0
    ALLOW_OVERRIDE = 1 << 0
    ALLOW_MULTI = 1 << 1
    REPLACE = 1 << 2  # Linux 5.6: swap one program of a MULTI list in place


QUERY_EFFECTIVE = 1 << 0
"""``BPF_F_QUERY_EFFECTIVE``: the programs that run for the cgroup, ancestors included."""

_SYSCALL_NUMBERS = {"x86_64": 321, "aarch64": 280}

_LOAD_ATTEMPTS = 5
_LOG_SIZE_START = 64 * 1024
_LOG_SIZE_MAX = 16 * 1024 * 1024
_QUERY_ATTEMPTS = 8
_QUERY_CAPACITY = 64  # BPF_CGROUP_MAX_PROGS per cgroup, so one query usually suffices
_PROG_NAME_MAX = 15  # BPF_OBJ_NAME_LEN minus the terminating NUL
_LICENSE = b"BSD"  # device programs call no GPL-only helper, so any license loads


class BpfError(OSError):
    """A ``bpf(2)`` command failed; ``errno`` is the kernel's, ``command`` names it."""

    errno: int

    def __init__(self, command: Command, err: int, detail: str = "") -> None:
        super().__init__(err, f"bpf({command.name}): {os.strerror(err)}{detail}")
        self.command = command


class ProgramLoadError(BpfError):
    """The verifier refused a program; ``log`` holds its explanation (may be empty)."""

    def __init__(self, err: int, log: str) -> None:
        detail = f"\nverifier log:\n{log}" if log else " (the verifier left no log)"
        super().__init__(Command.PROG_LOAD, err, detail)
        self.log = log


class BpfUnavailableError(BpfError):
    """``bpf(2)`` cannot be called on this platform at all."""


class Fd:
    """An owned file descriptor, closed exactly once (by ``close`` or the ``with`` block)."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError("file descriptor already closed")
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Fd:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Fd({self._fd})"


# ---- the system call ------------------------------------------------------------------


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _syscall_number(command: Command) -> int:
    machine = platform.machine()
    if machine not in _SYSCALL_NUMBERS:
        raise BpfUnavailableError(command, errno.ENOSYS, f" (no bpf(2) number for {machine})")
    return _SYSCALL_NUMBERS[machine]


def _bpf(command: Command, attr: ctypes.Structure) -> int:
    """One raw call; the kernel accepts an attr shorter than its own and zero-fills the rest."""
    nr = _syscall_number(command)
    ctypes.set_errno(0)
    result = _libc().syscall(
        ctypes.c_long(nr),
        ctypes.c_long(command),
        ctypes.byref(attr),
        ctypes.c_ulong(ctypes.sizeof(attr)),
    )
    if result < 0:
        raise BpfError(command, ctypes.get_errno())
    return int(result)


# ---- BPF_PROG_LOAD ---------------------------------------------------------------------


class _ProgLoadAttr(ctypes.Structure):
    _fields_ = (
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * 16),
        ("prog_ifindex", ctypes.c_uint32),
        ("expected_attach_type", ctypes.c_uint32),
    )


def sanitize_prog_name(name: str) -> str:
    """The kernel accepts only ``[A-Za-z0-9_.]`` and 15 characters (EINVAL otherwise)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", name)[:_PROG_NAME_MAX]


def _is_transient(err: int) -> bool:
    """Whether repeating the same load may succeed.

    The verifier gives up with EAGAIN when a signal is pending (``do_check`` in
    kernel/bpf/verifier.c); runc and cilium/ebpf retry it a bounded number of times.
    """
    return err in (errno.EAGAIN, errno.EINTR)


def _load_once(
    code: bytes, name: bytes, prog_type: int, log: ctypes.Array[ctypes.c_char] | None
) -> int:
    insns = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(_LICENSE)
    attr = _ProgLoadAttr(
        prog_type=prog_type,
        insn_cnt=len(code) // 8,
        insns=ctypes.addressof(insns),
        license=ctypes.addressof(license_),
        prog_name=name,
    )
    if log is not None:
        attr.log_level = 1
        attr.log_size = ctypes.sizeof(log)
        attr.log_buf = ctypes.addressof(log)
    attempt = 1
    while True:
        try:
            return _bpf(Command.PROG_LOAD, attr)
        except BpfError as error:
            if not _is_transient(error.errno) or attempt == _LOAD_ATTEMPTS:
                raise
        attempt += 1


def prog_load(code: bytes, *, name: str, prog_type: int = PROG_TYPE_CGROUP_DEVICE) -> Fd:
    """Load a program; on refusal, load it again with a verifier log and raise that log.

    The first attempt has no log on purpose: a log buffer that turns out too small
    makes the kernel fail an otherwise valid load with ENOSPC. The second attempt
    only explains the failure, growing its buffer while the log does not fit.
    """
    if not code or len(code) % 8:
        raise ValueError(f"not a program: {len(code)} bytes")
    raw_name = sanitize_prog_name(name).encode()
    try:
        return Fd(_load_once(code, raw_name, prog_type, None))
    except BpfError as error:
        first_errno = error.errno
    log_size = _LOG_SIZE_START
    while True:
        log = ctypes.create_string_buffer(log_size)
        try:
            # The same program may load the second time (the failure was transient).
            return Fd(_load_once(code, raw_name, prog_type, log))
        except BpfError as error:
            if error.errno == errno.ENOSPC and log_size < _LOG_SIZE_MAX:
                log_size *= 4
                continue
            text = log.value.decode(errors="replace").rstrip()
            raise ProgramLoadError(first_errno, text) from error


# ---- BPF_PROG_ATTACH / BPF_PROG_DETACH -------------------------------------------------


class _ProgAttachAttr(ctypes.Structure):
    _fields_ = (
        ("target_fd", ctypes.c_uint32),
        ("attach_bpf_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("attach_flags", ctypes.c_uint32),
        ("replace_bpf_fd", ctypes.c_uint32),
    )


def prog_attach(
    target: Fd,
    prog: Fd,
    *,
    flags: AttachFlags,
    replace: Fd | None = None,
    attach_type: int = ATTACH_CGROUP_DEVICE,
) -> None:
    """Attach ``prog`` to the cgroup ``target``; with ``replace``, swap that program in place.

    Passing ``replace`` adds ``REPLACE`` to ``flags``; the kernel requires
    ``ALLOW_MULTI`` with it and fails with ENOENT when ``replace`` is no longer
    attached there (someone changed the list since it was read).
    """
    attr = _ProgAttachAttr(
        target_fd=target.fileno(),
        attach_bpf_fd=prog.fileno(),
        attach_type=attach_type,
        attach_flags=flags | (AttachFlags.REPLACE if replace is not None else 0),
        replace_bpf_fd=replace.fileno() if replace is not None else 0,
    )
    _bpf(Command.PROG_ATTACH, attr)


def prog_detach(target: Fd, prog: Fd, *, attach_type: int = ATTACH_CGROUP_DEVICE) -> None:
    attr = _ProgAttachAttr(
        target_fd=target.fileno(), attach_bpf_fd=prog.fileno(), attach_type=attach_type
    )
    _bpf(Command.PROG_DETACH, attr)


@functools.cache
def supports_replace() -> bool:
    """Whether the kernel knows ``BPF_F_REPLACE`` (Linux 5.6); probed once per process.

    The probe has no side effects: the kernel validates the flags before it looks
    at either descriptor, so with invalid descriptors it answers EINVAL for an
    unknown flag and EBADF otherwise (the same trick as cilium/ebpf's
    ``haveProgAttachReplace``).
    """
    attr = _ProgAttachAttr(
        target_fd=0xFFFF_FFFF,
        attach_bpf_fd=0xFFFF_FFFF,
        attach_type=ATTACH_CGROUP_DEVICE,
        attach_flags=AttachFlags.ALLOW_MULTI | AttachFlags.REPLACE,
    )
    try:
        _bpf(Command.PROG_ATTACH, attr)
    except BpfError as error:
        if error.errno == errno.EBADF:
            return True
        if error.errno == errno.EINVAL:
            return False
        raise
    raise BpfError(Command.PROG_ATTACH, errno.EPROTO, " (probe with invalid fds succeeded)")


# ---- BPF_PROG_QUERY --------------------------------------------------------------------


class _ProgQueryAttr(ctypes.Structure):
    _fields_ = (
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("query_flags", ctypes.c_uint32),
        ("attach_flags", ctypes.c_uint32),
        ("prog_ids", ctypes.c_uint64),
        ("prog_cnt", ctypes.c_uint32),
    )


@dataclass(frozen=True)
class QueryResult:
    """The programs attached to a cgroup, in the order the kernel runs them."""

    attach_flags: AttachFlags
    prog_ids: tuple[ProgId, ...]


def prog_query(
    target: Fd, *, effective: bool = False, attach_type: int = ATTACH_CGROUP_DEVICE
) -> QueryResult:
    """The programs attached at ``target`` (or, ``effective``, those that run for it).

    The kernel answers ENOSPC with the real count when the id array is too small;
    the array then grows, a bounded number of times since the list can grow
    between calls.
    """
    capacity = _QUERY_CAPACITY
    for _ in range(_QUERY_ATTEMPTS):
        ids = (ctypes.c_uint32 * capacity)()
        attr = _ProgQueryAttr(
            target_fd=target.fileno(),
            attach_type=attach_type,
            query_flags=QUERY_EFFECTIVE if effective else 0,
            prog_ids=ctypes.addressof(ids),
            prog_cnt=capacity,
        )
        try:
            _bpf(Command.PROG_QUERY, attr)
        except BpfError as error:
            if error.errno == errno.ENOSPC:
                capacity = max(attr.prog_cnt, capacity * 2)
                continue
            raise
        return QueryResult(
            AttachFlags(attr.attach_flags), tuple(ProgId(i) for i in ids[: attr.prog_cnt])
        )
    raise BpfError(Command.PROG_QUERY, errno.ENOSPC, " (program list kept growing)")


# ---- BPF_PROG_GET_FD_BY_ID -------------------------------------------------------------


class _GetIdAttr(ctypes.Structure):
    _fields_ = (
        ("prog_id", ctypes.c_uint32),
        ("next_id", ctypes.c_uint32),
        ("open_flags", ctypes.c_uint32),
    )


def prog_get_fd_by_id(prog_id: ProgId) -> Fd:
    """A descriptor for a loaded program; ENOENT once the program is gone."""
    return Fd(_bpf(Command.PROG_GET_FD_BY_ID, _GetIdAttr(prog_id=prog_id)))


# ---- BPF_OBJ_GET_INFO_BY_FD ------------------------------------------------------------


class _InfoAttr(ctypes.Structure):
    _fields_ = (
        ("bpf_fd", ctypes.c_uint32),
        ("info_len", ctypes.c_uint32),
        ("info", ctypes.c_uint64),
    )


class _ProgInfoStruct(ctypes.Structure):
    """The prefix of ``struct bpf_prog_info`` up to ``name``."""

    _fields_ = (
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * 16),
    )


@dataclass(frozen=True)
class ProgInfo:
    """What the kernel tells about a loaded program; ``xlated`` is its instructions."""

    id: ProgId
    type: int
    name: str
    xlated: bytes


def _get_info(prog: Fd, info: _ProgInfoStruct) -> None:
    attr = _InfoAttr(
        bpf_fd=prog.fileno(), info_len=ctypes.sizeof(info), info=ctypes.addressof(info)
    )
    _bpf(Command.OBJ_GET_INFO_BY_FD, attr)


def prog_info(prog: Fd) -> ProgInfo:
    """Id, type, name and translated instructions of a program.

    Two calls: the first learns the length, the second fills a buffer of that
    size. The kernel withholds the instructions from callers without CAP_BPF
    (length 0) and, for constant-blinded programs, from callers that may not see
    raw kernel pointers (address 0); both raise EPERM rather than return a
    program that is not the one running.
    """
    sizing = _ProgInfoStruct()
    _get_info(prog, sizing)
    if sizing.xlated_prog_len == 0:
        raise BpfError(Command.OBJ_GET_INFO_BY_FD, errno.EPERM, " (instructions withheld)")
    buffer = ctypes.create_string_buffer(sizing.xlated_prog_len)
    info = _ProgInfoStruct(
        xlated_prog_len=sizing.xlated_prog_len, xlated_prog_insns=ctypes.addressof(buffer)
    )
    _get_info(prog, info)
    if info.xlated_prog_insns == 0:
        raise BpfError(Command.OBJ_GET_INFO_BY_FD, errno.EPERM, " (instructions withheld)")
    return ProgInfo(
        id=ProgId(info.id),
        type=info.type,
        name=info.name.decode(errors="replace"),
        xlated=buffer.raw[: sizing.xlated_prog_len],
    )
