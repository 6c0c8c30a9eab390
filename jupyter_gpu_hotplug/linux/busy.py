"""Which processes of a container hold a device open — and ending them when forced.

Why this module exists: revoking a device cgroup permission only stops *new*
opens; a process that already holds ``/dev/nvidia3`` keeps using the GPU. So a
detach first asks who holds the device (to refuse with the pids and command
names, DESIGN §4) and, when forced, ends exactly those processes. Two rules
shape it: a scan that could not look at a process must say so rather than
report "not busy", and a signal must never reach an unrelated process that
inherited a reused pid — processes are identified by pid *and* start time, and
signalled through a pidfd.

Holders are found from ``/proc/<pid>/fd`` (an open fd whose target is the char
device); an optional second source — NVML's running processes — can add pids that
use the device without a visible fd. Asking about several devices at once walks
each process's fds once for all of them (``holders_by_device``): the walk, one
``stat`` per open fd of every process in the container, is the cost.

What "not busy" means (issue 25). An fd is not only in fd tables: a process can send
it through a unix socket (``SCM_RIGHTS``) and close its own copy; while the message
waits in a socket's queue no ``/proc/<pid>/fd`` shows it, and the process receives
it back whenever it likes — after the GPU went to someone else, and an fd already
open keeps working on a real driver whatever the cgroup says. Which fds a queued
message carries cannot be read without receiving it, so the scan is conservative: a
process that holds a unix socket with anything queued — in its receive queue (even a
message of no bytes, or a connection not yet accepted) or sent and not yet received
(``SIOCOUTQ``) — counts as a holder of every device asked about (``Holder.queued``).
The check looks at duplicates of the sockets (``pidfd_getfd(2)``, Linux 5.6): one
``poll`` for a batch of them, an ``ioctl`` each, and never reads from them. So "not busy" means: no
process of the container has the device open, none has an fd of any kind in flight on
a unix socket it holds, and (on real hardware) NVML lists none of them as using the
GPU. What it cannot see: an fd handed to a process *outside* the container (that is
the other container's to account for); one in flight between two sockets of which the
container holds neither (then no process of it can receive it); and one in a message of
no bytes on a ``SOCK_SEQPACKET`` socket whose peer has closed (the kernel reports that
socket as at its end with nothing to read, and telling the two apart would mean receiving).

The scan has a deadline (``deadline``): a container with 500 processes x 2,000 fds
took 25-45 s; past the deadline it stops with :class:`ScanTimeout`, saying how far it
got, and the caller answers "try again" instead of holding the request.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import math
import os
import select
import signal
import socket
import stat
import struct
import termios
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from . import cgroups, procfs
from .devrules import CharDevice

ExtraHolders = Callable[[CharDevice], Iterable[int]]
"""Another source of pids using a device (e.g. NVML's running processes)."""

_PROC: Final = procfs.PROC
# /proc/<pid>/stat after the ")" that ends comm: field 3 (state) is index 0, so
# field 22 (starttime, in clock ticks since boot) is index 19.


class BusyError(Exception):
    """Base of this module's errors."""


class ScanTimeout(BusyError):
    """The scan reached its deadline before it looked at every process."""

    def __init__(self, scanned: int, total: int) -> None:
        super().__init__(
            f"the scan for open devices looked at {scanned} of {total} processes before its "
            "deadline"
        )
        self.scanned = scanned
        self.total = total


class ScanError(BusyError):
    """Some processes could not be inspected, so "who holds it" has no full answer.

    ``holders`` are the ones found anyway; ``unreadable`` pairs each pid that could
    not be inspected with the reason.
    """

    def __init__(
        self, holders: tuple[Holder, ...], unreadable: tuple[tuple[int, str], ...]
    ) -> None:
        listed = "; ".join(f"pid {pid}: {reason}" for pid, reason in unreadable)
        super().__init__(f"cannot inspect every process of the container ({listed})")
        self.holders = holders
        self.unreadable = unreadable


@dataclass(frozen=True)
class Holder:
    """A process that holds a device open."""

    pid: int
    comm: str
    """The command name (``/proc/<pid>/comm``), for the message the user sees."""
    fds: tuple[int, ...]
    """Its fds open on the device; empty when only the extra source reported it."""
    start_time: int
    """Start time in clock ticks since boot: with ``pid``, who this process is."""
    queued: tuple[int, ...] = ()
    """Its unix sockets (fds) with a message queued, which may carry an fd of the device
    (module docstring): it is a holder of every device asked about."""


@dataclass(frozen=True)
class Termination:
    """What :func:`terminate` did, per pid."""

    exited: tuple[int, ...]
    """Ended within the grace period after SIGTERM."""
    killed: tuple[int, ...]
    """Ignored SIGTERM, ended after SIGKILL."""
    survivors: tuple[int, ...]
    """Still alive after SIGKILL and the wait (e.g. stuck in uninterruptible sleep)."""
    vanished: tuple[int, ...]
    """Already gone before any signal (their pid may now be someone else's)."""

    @property
    def all_gone(self) -> bool:
        return not self.survivors


def find_holders(
    cgroup_dirs: Iterable[Path],
    device: CharDevice,
    *,
    proc: Path = _PROC,
    extra_holders: ExtraHolders | None = None,
) -> list[Holder]:
    """The processes in ``cgroup_dirs`` (and the cgroups below them) holding ``device``.

    Pass the container's v1 ``devices`` and/or unified cgroup directories; pids are
    in our pid namespace and ``proc`` is that namespace's procfs.
    """
    found = find_holders_by_device(cgroup_dirs, [device], proc=proc, extra_holders=extra_holders)
    return found[device]


def find_holders_by_device(
    cgroup_dirs: Iterable[Path],
    devices: Iterable[CharDevice],
    *,
    proc: Path = _PROC,
    extra_holders: ExtraHolders | None = None,
    deadline: float | None = None,
) -> dict[CharDevice, list[Holder]]:
    """:func:`find_holders` for several devices, with one scan of the container."""
    pids: set[int] = set()
    for directory in cgroup_dirs:
        pids.update(cgroups.pids_in_cgroup(directory, recursive=True))
    return holders_by_device(
        pids, devices, proc=proc, extra_holders=extra_holders, deadline=deadline
    )


def holders_among(
    pids: Iterable[int],
    device: CharDevice,
    *,
    proc: Path = _PROC,
    extra_holders: ExtraHolders | None = None,
) -> list[Holder]:
    """Which of ``pids`` hold ``device`` open, sorted by pid.

    A process that exits during the scan is simply not a holder. One that cannot be
    inspected (EACCES, for one) makes the whole answer unknown: :class:`ScanError`,
    carrying what was found. Pids from ``extra_holders`` count only if they are
    among ``pids`` — a process outside the container is not ours to report or end.
    """
    return holders_by_device(pids, [device], proc=proc, extra_holders=extra_holders)[device]


def holders_by_device(
    pids: Iterable[int],
    devices: Iterable[CharDevice],
    *,
    proc: Path = _PROC,
    extra_holders: ExtraHolders | None = None,
    deadline: float | None = None,
) -> dict[CharDevice, list[Holder]]:
    """:func:`holders_among` for several devices: each device (every one asked about is
    a key) with its holders, sorted by pid. Each process's fds are walked once.

    A process holding several of the devices is a holder of each, with that device's
    fds. :class:`ScanError` carries the holders found of every device; past ``deadline``
    (a ``time.monotonic()`` value) the scan stops with :class:`ScanTimeout`.
    """
    candidates = sorted(set(pids))
    wanted = {os.makedev(device.major, device.minor): device for device in devices}
    found: dict[CharDevice, dict[int, Holder]] = {device: {} for device in wanted.values()}
    unreadable: list[tuple[int, str]] = []
    for scanned, pid in enumerate(candidates):
        if deadline is not None and time.monotonic() >= deadline:
            raise ScanTimeout(scanned, len(candidates))
        try:
            held = _inspect(pid, wanted, proc)
        except OSError as e:
            unreadable.append((pid, f"{e.filename}: {e.strerror}"))
            continue
        for device, holder in held.items():
            found[device][pid] = holder
    if extra_holders is not None:
        for device, holders in found.items():
            for pid in sorted(set(extra_holders(device)).intersection(candidates)):
                if pid in holders:
                    continue
                try:
                    identity = procfs.identity(pid, proc=proc)
                except OSError as e:
                    unreadable.append((pid, f"{e.filename}: {e.strerror}"))
                    continue
                if identity is not None:
                    holders[pid] = Holder(pid, identity.comm, (), identity.start_time)
    result = {
        device: [holders[pid] for pid in sorted(holders)] for device, holders in found.items()
    }
    if unreadable:
        every = tuple(holder for holders in result.values() for holder in holders)
        raise ScanError(every, tuple(unreadable))
    return result


def _inspect(pid: int, wanted: Mapping[int, CharDevice], proc: Path) -> dict[CharDevice, Holder]:
    """The process as a holder of each ``wanted`` device (by ``st_rdev``) it has open, or of
    all of them when a unix socket of it has a message queued; empty when it holds none,
    exited, or its pid was reused while we looked (its identity changed between the reads)."""
    before = procfs.identity(pid, proc=proc)
    if before is None:
        return {}
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError as e:
        if procfs.is_gone(e):
            return {}
        raise
    fds: dict[CharDevice, list[int]] = {}
    sockets: list[int] = []
    for name in names:
        try:
            info = os.stat(fd_dir / name)  # follows the fd to the file it has open
        except OSError as e:
            if procfs.is_gone(e):
                continue  # closed since we listed it
            raise
        if stat.S_ISCHR(info.st_mode) and info.st_rdev in wanted:
            fds.setdefault(wanted[info.st_rdev], []).append(int(name))
        elif stat.S_ISSOCK(info.st_mode):
            sockets.append(int(name))
    queued = _queued_sockets(pid, sockets) if sockets else ()
    if procfs.identity(pid, proc=proc) != before:
        return {}
    return {
        device: Holder(
            pid, before.comm, tuple(sorted(fds.get(device, ()))), before.start_time, queued
        )
        for device in wanted.values()
        if device in fds or queued
    }


# --- fds in flight -------------------------------------------------------------------------------

_SYS_PIDFD_GETFD: Final = 438
"""``pidfd_getfd(2)``: the same number on every architecture (new syscalls share one table)."""
_BATCH: Final = 256
"""Duplicates held at once while looking at a process's sockets."""
_SO_DOMAIN: Final = 39
"""``<asm-generic/socket.h>``."""
_libc = ctypes.CDLL(None, use_errno=True)
_INT: Final = struct.Struct("i")


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    """A duplicate, in this process, of ``fd`` of the process of ``pidfd``."""
    ours = int(_libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
    if ours < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return ours


def _queued_sockets(pid: int, fds: Sequence[int]) -> tuple[int, ...]:
    """Which of the socket ``fds`` of ``pid`` are unix sockets with a message queued either
    way (module docstring). Looks at duplicates, polled ``_BATCH`` at a time (the agent's own
    descriptors are bounded too); never reads from them."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return ()
    try:
        queued: list[int] = []
        for start in range(0, len(fds), _BATCH):
            queued += _queued_batch(pidfd, fds[start : start + _BATCH])
        return tuple(sorted(queued))
    finally:
        os.close(pidfd)


def _queued_batch(pidfd: int, fds: Sequence[int]) -> list[int]:
    ours: dict[int, int] = {}  # our duplicate -> the process's fd
    try:
        for fd in fds:
            try:
                dup = _pidfd_getfd(pidfd, fd)
            except OSError as e:
                if e.errno in (errno.EBADF, errno.ESRCH):
                    continue  # closed since we listed it, or the process exited
                raise
            ours[dup] = fd
            if _domain(dup) != socket.AF_UNIX:
                del ours[dup]
                os.close(dup)
        return [ours[dup] for dup in _with_queued(list(ours))]
    finally:
        for dup in ours:
            os.close(dup)


def _domain(fd: int) -> int:
    """The address family of socket ``fd`` (``SO_DOMAIN``), without a socket object."""
    value = ctypes.c_int(0)
    size = ctypes.c_uint32(ctypes.sizeof(value))
    if _libc.getsockopt(fd, socket.SOL_SOCKET, _SO_DOMAIN, ctypes.byref(value), ctypes.byref(size)):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return value.value


def _with_queued(fds: list[int]) -> list[int]:
    """Those of the unix sockets ``fds`` with anything in their receive queue (a message,
    even of no bytes, or an unaccepted connection: ``POLLIN`` without end-of-stream), or
    bytes waiting there (``SIOCINQ``, for one whose peer has shut down), or something sent
    and not yet received (``SIOCOUTQ``: memory still charged to it)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLRDHUP)
    ready = dict(poller.poll(0))
    found = []
    for fd in fds:
        mask = ready.get(fd, 0)
        if mask & select.POLLIN and not mask & select.POLLRDHUP:
            found.append(fd)
            continue
        counts = (
            (termios.TIOCOUTQ, termios.FIONREAD) if mask & select.POLLRDHUP else (termios.TIOCOUTQ,)
        )
        if any(_count(fd, request) for request in counts):
            found.append(fd)
    return found


def _count(fd: int, request: int) -> int:
    """A socket's byte count (``SIOCINQ``/``SIOCOUTQ``); 0 where it has none (a listening
    socket: ``EINVAL``)."""
    try:
        answer = fcntl.ioctl(fd, request, _INT.pack(0))
    except OSError:
        return 0
    return int(_INT.unpack(answer)[0])


def terminate(
    holders: Iterable[Holder],
    *,
    grace: float = 5.0,
    kill_wait: float = 5.0,
    proc: Path = _PROC,
) -> Termination:
    """SIGTERM every holder, wait up to ``grace`` seconds, SIGKILL the ones left, wait
    up to ``kill_wait`` for them, and report who ended how.

    Each process is pinned by a pidfd whose identity is checked against the holder's
    start time before any signal; waiting polls the pidfds (readable once the
    process has exited), so it ends as soon as everyone is gone.
    """
    pidfds: dict[int, int] = {}
    vanished: list[int] = []
    try:
        for holder in holders:
            pidfd = _pin(holder, proc)
            if pidfd is None:
                vanished.append(holder.pid)
            else:
                pidfds[holder.pid] = pidfd
        for pid in [pid for pid, pidfd in pidfds.items() if not _signal(pidfd, signal.SIGTERM)]:
            vanished.append(pid)
            os.close(pidfds.pop(pid))
        exited = _wait_exit(pidfds, grace)
        stubborn = {pid: pidfd for pid, pidfd in pidfds.items() if pid not in exited}
        for pidfd in stubborn.values():
            _signal(pidfd, signal.SIGKILL)
        killed = _wait_exit(stubborn, kill_wait)
    finally:
        for pidfd in pidfds.values():
            os.close(pidfd)
    return Termination(
        exited=tuple(sorted(exited)),
        killed=tuple(sorted(killed)),
        survivors=tuple(sorted(set(stubborn) - killed)),
        vanished=tuple(sorted(vanished)),
    )


def _pin(holder: Holder, proc: Path) -> int | None:
    """A pidfd of exactly this holder, or None if it is gone (or its pid reused)."""
    try:
        pidfd = os.pidfd_open(holder.pid)
    except ProcessLookupError:
        return None
    try:
        identity = procfs.identity(holder.pid, proc=proc)
    except OSError:
        os.close(pidfd)
        raise
    if identity is None or identity.start_time != holder.start_time:
        os.close(pidfd)
        return None
    return pidfd


def _signal(pidfd: int, signum: signal.Signals) -> bool:
    """Send ``signum``; False when the process has already been reaped."""
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        return False
    return True


def _wait_exit(pidfds: dict[int, int], timeout: float) -> set[int]:
    """The pids whose process exits within ``timeout`` seconds (a pidfd turns readable)."""
    by_fd = {pidfd: pid for pid, pidfd in pidfds.items()}
    poller = select.poll()
    for pidfd in by_fd:
        poller.register(pidfd, select.POLLIN)
    done: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(done) < len(by_fd):
        remaining = deadline - time.monotonic()
        events = poller.poll(max(0, math.ceil(remaining * 1000)))
        for pidfd, _ in events:
            done.add(by_fd[pidfd])
            poller.unregister(pidfd)
        if not events and remaining <= 0:
            break
    return done
