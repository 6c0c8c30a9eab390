"""In-sandbox bootstrap: build the private mount namespace and ``/dev``, join the cgroups, exec.

Boundary: this file runs as its own short-lived process, started by
:mod:`jupyter_gpu_hotplug.linux.sandbox.runtime` as ``python -I -S _init.py CFG_FD STATUS_FD``
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
import platform
import resource
import select
import signal
import stat
import struct
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

# Flags from <sys/mount.h> and <sched.h>; stable kernel ABI.
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
#: Every namespace flag ``clone`` takes (CLONE_NEWTIME's bit is CSIGNAL's there).
CLONE_NAMESPACES = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
    | CLONE_NEWNET
)  # fmt: skip
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_PRIVATE = 1 << 18
MS_STRICTATIME = 1 << 24
MNT_DETACH = 0x2
# mount_setattr(2) (Linux 5.12; the same number on every architecture but alpha) and
# <linux/mount.h>: change a whole mount tree's attributes at once, keeping its other flags.
SYS_MOUNT_SETATTR = 442
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
# <linux/prctl.h> and <linux/capability.h>.
PR_SET_PDEATHSIG = 1
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_SPEC_ALLOW = 1 << 2
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522

READY = b"R"
ERROR = b"E"
EXIT_SETUP_FAILED = 127
#: What the sandbox's init tells the outer process when the workload ended: ``X<status>``
#: (exited) or ``S<signal>`` (killed), so the outer one ends the same way.
EXITED = b"X"
KILLED = b"S"
#: Seconds between two checks that the sandbox's owner still runs (ipykernel's parent poller
#: checks as often).
OWNER_CHECK_INTERVAL = 1.0
#: Signals the outer process passes to the sandbox's init, and init to the workload's process
#: group: what a kernel provisioner or ``Sandbox.send_signal`` sends (SIGKILL needs no relay:
#: init dies with the outer process, and the pid namespace with init).
RELAYED = (
    signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
    signal.SIGTERM, signal.SIGCONT, signal.SIGWINCH, signal.SIGALRM,
)  # fmt: skip

#: Size of the private ``/dev`` tmpfs: it only holds device nodes and symlinks (runc's value).
DEV_TMPFS_OPTIONS = "mode=755,size=65536k"
#: ``/dev/pts``: a fresh devpts instance, so the sandbox sees only its own ptys (runc's options).
DEVPTS_OPTIONS = "newinstance,ptmxmode=0666,mode=0620,gid=5"
#: Parts of a writable ``/proc`` that stay read-only: the host's sysctls and their kin
#: (Docker's ``ReadonlyPaths``); root could otherwise change the host's kernel settings.
PROC_READ_ONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
#: What covers a hidden path: an empty, read-only tmpfs nobody may enter.
HIDE_OPTIONS = "mode=000,size=4k"
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
    capabilities: list[int] | None
    read_only: bool
    writable: list[str]
    hidden: list[str]
    end_with_owner: bool

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
            capabilities=raw["capabilities"],
            read_only=bool(raw["read_only"]),
            writable=[str(p) for p in raw["writable"]],
            hidden=[str(p) for p in raw["hidden"]],
            end_with_owner=bool(raw["end_with_owner"]),
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
    """A mount namespace for us, and a pid namespace for our next child (its init)."""
    _check(
        _libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare", "unshare(CLONE_NEWNS|CLONE_NEWPID)"
    )
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


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


def _set_read_only(path: str, *, read_only: bool, recursive: bool) -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY if read_only else 0, 0 if read_only else MOUNT_ATTR_RDONLY)
    flags = AT_RECURSIVE if recursive else 0
    result = _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(result, "read-only", f"mount_setattr {path} ({'ro' if read_only else 'rw'})")


def _existing(paths: list[str]) -> list[str]:
    """The paths that exist, resolved (a mount follows symlinks: name what it will cover)."""
    return sorted({os.path.realpath(p) for p in paths if os.path.exists(p)})


def _hide(paths: list[str]) -> None:
    """Cover each path (the agent's state directory...) with an empty read-only tmpfs.

    Without ``CAP_SYS_ADMIN`` the workload can never unmount it, and without
    ``CAP_SYS_PTRACE`` it cannot reach the original through ``/proc/<agent pid>/root``.
    """
    for path in _existing(paths):
        if os.path.isdir(path):
            _mount(
                "hide",
                "tmpfs",
                path,
                "tmpfs",
                MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY,
                HIDE_OPTIONS,
            )
        else:
            _mount("hide", "/dev/null", path, None, MS_BIND, None)
            _mount("hide", "none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)


def _read_only_view(writable: list[str]) -> None:
    """Everything read-only but ``/dev`` and the ``writable`` paths (and what is below them).

    Each writable path becomes a bind mount of itself first, so that it can be made
    writable again on its own after the whole tree was made read-only in one call.
    ``/sys`` (the cgroup filesystems above all) stays read-only: a root workload could
    otherwise move itself out of its device cgroup; so do ``PROC_READ_ONLY`` when ``/proc``
    is among the writable paths.
    """
    # Never "/" itself (a kernel started in /): that would make the whole root writable.
    keep = [path for path in _existing(writable) if path != "/"]
    for path in keep:
        _mount("writable", path, path, None, MS_BIND | MS_REC, None)
    _set_read_only("/", read_only=True, recursive=True)
    _set_read_only("/dev", read_only=False, recursive=True)  # ours: tmpfs, devpts, shm
    for path in keep:
        _set_read_only(path, read_only=False, recursive=False)
    if "/proc" in keep:
        for path in _existing(list(PROC_READ_ONLY)):
            _mount("read-only", path, path, None, MS_BIND | MS_REC, None)
            _set_read_only(path, read_only=True, recursive=True)


def _limit_capabilities(keep: list[int]) -> None:
    """Drop every capability outside ``keep`` from the bounding set (so no exec, not even
    of a set-uid binary, can regain it) and clear the ambient set; ``_restrict_capabilities``
    later trims what the process holds."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError) as e:
        raise SetupError("capabilities", f"cannot read cap_last_cap: {e}") from e
    for cap in range(last + 1):
        if cap not in keep:
            _check(
                _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "capabilities", f"drop capability {cap}"
            )
    _check(
        _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0),
        "capabilities",
        "clear the ambient capabilities",
    )


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def _restrict_capabilities(keep: list[int]) -> None:
    """Effective, permitted and inheritable sets: what they hold now, within ``keep``."""
    mask = sum(1 << cap for cap in keep)
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "capabilities", "capget")
    for word in range(2):
        allowed = (mask >> (32 * word)) & 0xFFFFFFFF
        data[word].effective &= allowed
        data[word].permitted &= allowed
        data[word].inheritable &= allowed
    _check(_libc.capset(ctypes.byref(header), data), "capabilities", "capset")


# ---- seccomp --------------------------------------------------------------------------------
#
# Docker's default profile (moby profiles/seccomp/default.json) allows a list of ~350 system
# calls and refuses the rest with EPERM; what it refuses a container without extra
# capabilities is what matters here, and this filter refuses exactly that set by name: the
# namespace and mount calls (a sandbox must never build a user namespace in which it holds
# every capability), bpf, ptrace and the other process-inspection calls, module and kexec
# loading, the clock, swap, reboot, quota and accounting calls, keyrings, userfaultfd and
# perf events. clone is allowed unless it asks for a namespace; clone3, whose flags a classic
# BPF filter cannot read (they sit behind a pointer), answers ENOSYS, as in Docker, so that
# libc falls back to clone. A classic BPF program installed with prctl is all it takes
# (the kernel's own interface; no libseccomp needed, so nothing to install). It is a list of
# names, not of numbers: the numbers below are each architecture's.

# <linux/filter.h> and <linux/seccomp.h>, <linux/audit.h>.
_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_JSET_K = 0x45
_BPF_RET_K = 0x06
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_RET_KILL_PROCESS = 0x80000000
_DATA_NR, _DATA_ARCH, _DATA_ARG0 = 0, 4, 16
_X32_SYSCALL_BIT = 0x40000000

REFUSED_SYSCALLS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount",
    "fspick", "move_mount", "open_tree", "mount_setattr", "bpf", "ptrace",
    "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "perf_event_open",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "syslog", "vhangup", "keyctl", "add_key", "request_key",
    "userfaultfd", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
)  # fmt: skip
"""What the sandbox may never call (EPERM), by name."""

# Syscall numbers, (x86_64, aarch64): arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h (arm64); calls added since Linux 5.1 share one number.
_NUMBERS: dict[str, tuple[int, int]] = {
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "bpf": (321, 280), "ptrace": (101, 117),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "perf_event_open": (298, 241), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "reboot": (169, 142), "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89),
    "quotactl": (179, 60), "settimeofday": (164, 170), "clock_settime": (227, 112),
    "clock_adjtime": (305, 266), "adjtimex": (159, 171), "syslog": (103, 116),
    "vhangup": (153, 58), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "userfaultfd": (323, 282), "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264), "lookup_dcookie": (212, 18), "clone": (56, 220),
    "seccomp": (317, 277), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "clone3": (435, 435), "pidfd_getfd": (438, 438), "mount_setattr": (442, 442),
}  # fmt: skip
#: ``platform.machine()`` → (AUDIT_ARCH, which column of ``_NUMBERS``).
_ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}
SYSCALL_TABLES: dict[str, tuple[int, dict[str, int]]] = {
    machine: (arch, {name: pair[column] for name, pair in _NUMBERS.items()})
    for machine, (arch, column) in _ARCHES.items()
}
"""``platform.machine()`` → (its AUDIT_ARCH, system call name → number)."""


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter for ``machine`` (``platform.machine()``), as ``(code, jt, jf, k)``.

    Another architecture's system calls are refused outright (the numbers would mean other
    calls), and on x86_64 so are the x32 ones.
    """
    if machine not in SYSCALL_TABLES:
        raise SetupError("seccomp", f"no system call table for {machine}")
    arch, numbers = SYSCALL_TABLES[machine]
    errno_eperm = _SECCOMP_RET_ERRNO | errno.EPERM
    program = [
        (_BPF_LD_W_ABS, 0, 0, _DATA_ARCH),
        (_BPF_JEQ_K, 1, 0, arch),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),
        (_BPF_LD_W_ABS, 0, 0, _DATA_NR),
    ]
    if machine == "x86_64":
        program += [(_BPF_JGE_K, 0, 1, _X32_SYSCALL_BIT), (_BPF_RET_K, 0, 0, errno_eperm)]
    for name in REFUSED_SYSCALLS:
        program += [(_BPF_JEQ_K, 0, 1, numbers[name]), (_BPF_RET_K, 0, 0, errno_eperm)]
    program += [
        (_BPF_JEQ_K, 0, 1, numbers["clone3"]),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS),
        # clone: refused when its flags (the first argument's low word) ask for a namespace.
        (_BPF_JEQ_K, 0, 3, numbers["clone"]),
        (_BPF_LD_W_ABS, 0, 0, _DATA_ARG0),
        (_BPF_JSET_K, 0, 1, CLONE_NAMESPACES),
        (_BPF_RET_K, 0, 0, errno_eperm),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    return program


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _install_seccomp() -> None:
    """Install the filter on this process (and so on everything it will run). Done while
    it still holds CAP_SYS_ADMIN, so no ``no_new_privs`` is needed (set-uid programs work
    inside, as in Docker)."""
    machine = platform.machine()
    program = seccomp_program(machine)
    raw = b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(raw, len(raw))
    fprog = _SockFprog(len(program), ctypes.cast(buffer, ctypes.c_void_p))
    # seccomp(2) rather than prctl: only it takes SPEC_ALLOW, which keeps the kernel from
    # switching on its speculative-execution mitigations for the filtered tasks (as runc
    # does), a slowdown the workload would otherwise pay on every context switch.
    _check(
        _libc.syscall(
            ctypes.c_long(SYSCALL_TABLES[machine][1]["seccomp"]),
            ctypes.c_uint(SECCOMP_SET_MODE_FILTER),
            ctypes.c_uint(SECCOMP_FILTER_FLAG_SPEC_ALLOW),
            ctypes.byref(fprog),
        ),
        "seccomp",
        "install the seccomp filter",
    )


# ---- the pid namespace ---------------------------------------------------------------------


def _mount_proc() -> None:
    """A procfs of the sandbox's pid namespace instead of the host's: its processes only."""
    if _libc.umount2(b"/proc", MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise SetupError("mount-proc", f"umount /proc: {os.strerror(err)}", err)
    _mount("mount-proc", "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def _orphaned(report_fd: int) -> bool:
    """Whether the outer process is gone (the read end of our report pipe is closed)."""
    poller = select.poll()
    poller.register(report_fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _init(cfg: _Config, status_fd: int, mount_ns: int, report_fd: int) -> NoReturn:
    """Pid 1 of the sandbox: confine, start the workload, relay signals to it, reap."""
    try:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "init", "set PDEATHSIG")
        if _orphaned(report_fd):
            os._exit(EXIT_SETUP_FAILED)
        os.setpgid(0, 0)  # the provisioner's killpg of the outer process reaches us by relay
        _mount_proc()
        if cfg.read_only:
            _read_only_view(cfg.writable)
        if cfg.capabilities is not None:
            _limit_capabilities(cfg.capabilities)
        _install_seccomp()
        _drop_privileges(cfg)
        if cfg.capabilities is not None:
            _restrict_capabilities(cfg.capabilities)
        workload = os.fork()
        if workload == 0:
            os.close(report_fd)
            os.setsid()  # its own session and process group, as the command had before
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            _exec(cfg, status_fd, mount_ns)
    except SetupError as e:
        _report(status_fd, {"step": e.step, "errno": e.errno, "message": e.message})
    except Exception as e:
        _report(status_fd, {"step": "internal", "errno": None, "message": repr(e)})
    os.close(status_fd)
    _supervise(workload, report_fd)


def _supervise(workload: int, report_fd: int) -> NoReturn:
    """Relay signals to the workload's process group and reap every orphan until the
    workload ends; then report how it ended (the namespace dies with us)."""
    waited = {*RELAYED, signal.SIGCHLD}
    while True:
        signo = signal.sigwaitinfo(waited).si_signo
        if signo != signal.SIGCHLD:
            _relay(workload, signo, group=True)
            continue
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid, status = 0, 0
            if pid == 0:
                break
            if pid == workload:
                if os.WIFSIGNALED(status):
                    os.write(report_fd, KILLED + str(os.WTERMSIG(status)).encode())
                else:
                    os.write(report_fd, EXITED + str(os.waitstatus_to_exitcode(status)).encode())
                os._exit(0)


def _relay(pid: int, signo: int, *, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, signo)
        else:
            os.kill(pid, signo)
    except ProcessLookupError:
        if group:  # not yet (or no longer) a group leader
            _relay(pid, signo, group=False)


def _outer(init: int, report_fd: int, *, owner: int | None) -> NoReturn:
    """The process the caller started, outside the pid namespace: relay signals to the
    sandbox's init, then end as the workload ended (exit status or signal). With an
    ``owner``, the sandbox is killed once that parent of ours has gone (we were re-parented)."""
    waited = {*RELAYED, signal.SIGCHLD}
    while True:
        received = signal.sigtimedwait(waited, OWNER_CHECK_INTERVAL)
        if received is None:
            if owner is not None and os.getppid() != owner:
                _relay(init, signal.SIGKILL, group=False)  # the namespace dies with its init
                owner = None
            continue
        signo = received.si_signo
        if signo != signal.SIGCHLD:
            _relay(init, signo, group=False)
            continue
        pid, status = os.waitpid(init, os.WNOHANG)
        if pid == init:
            break
    report = os.read(report_fd, 64)
    if report.startswith(EXITED):
        os._exit(int(report[1:]))
    if report.startswith(KILLED):
        _die_by(int(report[1:]))
    if os.WIFSIGNALED(status):  # init itself was killed (SIGKILL from the caller)
        _die_by(os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _die_by(signo: int) -> NoReturn:
    """End by ``signo``, as the workload did (no core dump of ours)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signo, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signo})
    os.kill(os.getpid(), signo)
    os._exit(128 + signo)  # a signal that does not kill by default


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
    """Three processes: this one (outside, what the caller started and signals), the
    sandbox's init (pid 1 of a new pid namespace) and the workload (pid 2, exec'd)."""
    cfg_fd, status_fd = int(argv[1]), int(argv[2])
    owner = os.getppid()
    try:
        cfg = _read_config(cfg_fd)
        _private_mount_namespace()
        mount_ns = os.stat("/proc/self/ns/mnt").st_ino
        _detach_host_dev()
        _populate_dev(cfg.extra_nodes)
        _hide(cfg.hidden)
        # Join only now: creating /dev's nodes must not depend on the policy granting
        # mknod, and everything from here on (the exec above all) runs confined.
        _join_cgroups(cfg.cgroup_procs)
        # Blocked before the fork, so that no signal is lost before a relay waits for it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {*RELAYED, signal.SIGCHLD})
        report_r, report_w = os.pipe()
        # Read-only, seccomp and capabilities come in init, after its own /proc is mounted
        # (mounting needs CAP_SYS_ADMIN, the bounding set CAP_SETPCAP, the credentials
        # CAP_SETUID).
        init = os.fork()
        if init == 0:
            os.close(report_r)
            _init(cfg, status_fd, mount_ns, report_w)
    except SetupError as e:
        _report(status_fd, {"step": e.step, "errno": e.errno, "message": e.message})
    except Exception as e:  # Anything unforeseen must still reach the parent as an error.
        _report(status_fd, {"step": "internal", "errno": None, "message": repr(e)})
    os.close(report_w)
    os.close(status_fd)  # the workload's copy, closed by its exec, ends the parent's read
    _outer(init, report_r, owner=owner if cfg.end_with_owner else None)


def _report(status_fd: int, report: dict[str, Any]) -> NoReturn:
    os.write(status_fd, ERROR + json.dumps(report).encode())
    os._exit(EXIT_SETUP_FAILED)


if __name__ == "__main__":
    main(sys.argv)
