"""The cgroup v2 device controller: grant and revoke devices on one cgroup2 directory.

Boundary: a cgroup2 *directory* that the caller has resolved (from
``/proc/<pid>/cgroup``; nothing here builds cgroup paths from names) and device
rules from :mod:`jupyter_gpu_hotplug.linux.devrules`. It combines the pure
assembler (:mod:`.bpf.asm`) with the ``bpf(2)`` layer (:mod:`.bpf.syscall`) and
knows nothing of containers, pods or Jupyter. Walking from a process's leaf
cgroup up to the container scope is the caller's job.

Why it works the way it does: cgroup v2 has no ``devices.allow``. Every
``BPF_PROG_TYPE_CGROUP_DEVICE`` program attached to a cgroup and its ancestors
must allow an access, so attaching an extra "allow" program grants nothing.
Instead, :func:`grant` reads each program attached at the directory back from
the kernel, puts a marked block of allow rules in front of it, loads the result
and swaps it in atomically (``BPF_F_ALLOW_MULTI | BPF_F_REPLACE``), the
technique NVIDIA's libnvidia-container uses. :func:`revoke` strips the block
again; with nothing left granted the original instructions come back byte for
byte. It never detaches and re-attaches: between the two, every device would
be allowed.

Why apart from :mod:`.device_controllers.v2`: this is the eBPF program mechanism on one
directory, shared by both products of :mod:`.linux` (the sandbox runtime attaches a fresh
sandbox's program with :func:`attach_device_program`; the engine patches a container's
programs). The controller is the engine's policy on top: which directories, systemd's
``DeviceAllow=`` where systemd keeps the policy, the journal's undo; folding it in here would
make the sandbox runtime import the engine, which an import-linter contract forbids.

Both operations read the current programs each time, so they are idempotent and
survive someone else (systemd, the runtime) replacing a program in between;
they verify the result by reading it back, and undo a half-done multi-program
swap before raising.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Collection, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from jupyter_gpu_hotplug.linux.bpf import asm, syscall
from jupyter_gpu_hotplug.linux.bpf.syscall import AttachFlags, BpfError, Fd, ProgId
from jupyter_gpu_hotplug.linux.devrules import DeviceRule

__all__ = [
    "CgroupGoneError",
    "CgroupV2Error",
    "ConcurrentModificationError",
    "GrantChange",
    "NotCgroup2Error",
    "PermissionDeniedError",
    "ProgId",
    "ProgramInfo",
    "ProgramRejectedError",
    "ProgramSwap",
    "RollbackError",
    "UnreadableProgramError",
    "UnsupportedKernelError",
    "VerificationError",
    "attach_device_program",
    "attached_programs",
    "detach_program",
    "grant",
    "granted_devices",
    "revoke",
]

log = logging.getLogger(__name__)

_ATTEMPTS = 3
"""How often a grant or revoke starts over after losing a race with another writer."""

_DEFAULT_PROG_NAME = "gpu_hotplug"


# ---- errors --------------------------------------------------------------------------


class CgroupV2Error(Exception):
    """Base of everything this module raises; the kernel's error is chained."""


class CgroupGoneError(CgroupV2Error):
    """The directory does not exist (any more): its processes have probably exited."""


class NotCgroup2Error(CgroupV2Error):
    """The path is not a directory of a cgroup2 hierarchy (a v1 cgroup, or no cgroup)."""


class UnsupportedKernelError(CgroupV2Error):
    """The kernel lacks something required (``bpf(2)``, ``BPF_F_REPLACE``); retrying is useless."""


class PermissionDeniedError(CgroupV2Error):
    """The kernel refused a ``bpf(2)`` command: CAP_BPF/CAP_SYS_ADMIN or a LSM is missing."""


class UnreadableProgramError(PermissionDeniedError):
    """An attached program cannot be read back, so it cannot be patched.

    It is never skipped: leaving one program unpatched would leave the device
    denied (all programs must allow), and a silent partial grant is worse than
    a clear error.
    """

    def __init__(self, prog_id: ProgId, cgroup_dir: Path, reason: str) -> None:
        super().__init__(f"cannot read device program {prog_id} attached at {cgroup_dir}: {reason}")
        self.prog_id = prog_id


class ProgramRejectedError(CgroupV2Error):
    """The verifier refused a program we built; ``log`` is its explanation."""

    def __init__(self, message: str, log_text: str) -> None:
        super().__init__(f"{message}\nverifier log:\n{log_text}" if log_text else message)
        self.log = log_text


class ConcurrentModificationError(CgroupV2Error):
    """Someone else changed the directory's programs while we did; retrying may help."""


class VerificationError(CgroupV2Error):
    """After the swap, the kernel's state is not what we installed; ``change`` is what we did."""

    def __init__(self, message: str, change: GrantChange) -> None:
        super().__init__(message)
        self.change = change


class RollbackError(CgroupV2Error):
    """A failed multi-program swap could not be undone; the directory is half changed."""


def _translate(error: OSError, action: str) -> CgroupV2Error:
    """Classify a kernel error by what the caller can do about it."""
    if isinstance(error, syscall.BpfUnavailableError) or error.errno == errno.ENOSYS:
        return UnsupportedKernelError(f"{action}: {error}")
    if error.errno in (errno.EPERM, errno.EACCES):
        return PermissionDeniedError(f"{action}: {error}")
    return CgroupV2Error(f"{action}: {error}")


# ---- results -------------------------------------------------------------------------


@dataclass(frozen=True)
class ProgramInfo:
    """A device program attached at a directory, as far as we care about it."""

    id: ProgId
    name: str
    insn_count: int
    granted: frozenset[DeviceRule]
    """The devices our prefix on this program allows (empty: not patched by us)."""
    code: bytes = b""
    """Its instructions as the kernel holds them (``xlated_prog_insns``), for
    ``bpf.interp.allows``: what the whole program answers, whoever wrote it."""


@dataclass(frozen=True)
class ProgramSwap:
    """One program replaced in place: the ids, and our granted set before and after."""

    old_id: ProgId
    new_id: ProgId
    before: frozenset[DeviceRule]
    after: frozenset[DeviceRule]


@dataclass(frozen=True)
class GrantChange:
    """What one :func:`grant` or :func:`revoke` did, for logs and for undoing it.

    Undo a grant with :func:`revoke` of the same ``requested`` devices (and the
    reverse): the replaced programs themselves are gone once swapped out.
    """

    cgroup_dir: Path
    requested: frozenset[DeviceRule]
    swaps: tuple[ProgramSwap, ...]
    restricted: bool
    """False when no device program is attached here: this level limits no device
    (so there was nothing to grant), though an ancestor still may."""

    @property
    def changed(self) -> bool:
        return bool(self.swaps)

    @property
    def old_ids(self) -> tuple[ProgId, ...]:
        return tuple(swap.old_id for swap in self.swaps)

    @property
    def new_ids(self) -> tuple[ProgId, ...]:
        return tuple(swap.new_id for swap in self.swaps)


# ---- kernel access ----------------------------------------------------------------------


def _open_cgroup(cgroup_dir: Path) -> Fd:
    try:
        return Fd(os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except FileNotFoundError as error:
        raise CgroupGoneError(f"cgroup directory {cgroup_dir} does not exist") from error
    except NotADirectoryError as error:
        raise NotCgroup2Error(f"{cgroup_dir} is not a directory") from error
    except OSError as error:
        raise _translate(error, f"opening {cgroup_dir}") from error


def _query(cgroup: Fd, cgroup_dir: Path) -> syscall.QueryResult:
    try:
        return syscall.prog_query(cgroup)
    except BpfError as error:
        # cgroup_get_from_fd() answers EBADF for anything but a cgroup2 directory.
        if error.errno == errno.EBADF:
            raise NotCgroup2Error(f"{cgroup_dir} is not a cgroup2 directory") from error
        raise _translate(error, f"listing device programs at {cgroup_dir}") from error


def _open_program(prog_id: ProgId, cgroup_dir: Path) -> Fd:
    try:
        return syscall.prog_get_fd_by_id(prog_id)
    except BpfError as error:
        if error.errno == errno.ENOENT:
            raise ConcurrentModificationError(
                f"device program {prog_id} at {cgroup_dir} went away while we read it"
            ) from error
        if error.errno in (errno.EPERM, errno.EACCES):
            raise UnreadableProgramError(prog_id, cgroup_dir, str(error)) from error
        raise _translate(error, f"opening device program {prog_id}") from error


def _read_program(program: Fd, prog_id: ProgId, cgroup_dir: Path) -> syscall.ProgInfo:
    try:
        info = syscall.prog_info(program)
    except BpfError as error:
        if error.errno in (errno.EPERM, errno.EACCES):
            raise UnreadableProgramError(prog_id, cgroup_dir, str(error)) from error
        raise _translate(error, f"reading device program {prog_id}") from error
    if asm.uses_hidden_register(info.xlated):
        raise UnreadableProgramError(
            prog_id,
            cgroup_dir,
            "the JIT blinded its constants (net.core.bpf_jit_harden), so the instructions "
            "read back are not loadable",
        )
    return info


def _load(code: bytes, *, name: str, what: str) -> Fd:
    try:
        return syscall.prog_load(code, name=name)
    except syscall.ProgramLoadError as error:
        raise ProgramRejectedError(
            f"the kernel refused {what}: {error.strerror}", error.log
        ) from error
    except BpfError as error:
        raise _translate(error, f"loading {what}") from error


def _loaded_id(program: Fd) -> ProgId:
    try:
        return syscall.prog_info(program).id
    except BpfError as error:
        raise _translate(error, "reading the id of a program we loaded") from error


def _swap(cgroup: Fd, flags: AttachFlags, *, current: Fd, new: Fd, cgroup_dir: Path) -> None:
    """Replace ``current`` by ``new`` at the cgroup in one step, never leaving a gap."""
    try:
        if AttachFlags.ALLOW_MULTI in flags:
            syscall.prog_attach(cgroup, new, flags=AttachFlags.ALLOW_MULTI, replace=current)
        else:
            # An exclusive (flags 0 or ALLOW_OVERRIDE) attachment holds one program;
            # attaching again with the same flags replaces it in place
            # (__cgroup_bpf_attach in kernel/bpf/cgroup.c).
            syscall.prog_attach(cgroup, new, flags=flags)
    except BpfError as error:
        if error.errno == errno.ENOENT:
            raise ConcurrentModificationError(
                f"a device program at {cgroup_dir} was replaced by someone else meanwhile"
            ) from error
        raise _translate(error, f"swapping a device program at {cgroup_dir}") from error


def _require_replace() -> None:
    try:
        supported = syscall.supports_replace()
    except BpfError as error:
        raise _translate(error, "probing BPF_F_REPLACE") from error
    if not supported:
        raise UnsupportedKernelError(
            "the kernel lacks BPF_F_REPLACE (Linux 5.6): a device program cannot be swapped "
            "atomically, and detach-then-attach would briefly allow every device"
        )


# ---- grant and revoke ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """How one attached program changes: the original, our granted set, the new code."""

    old_id: ProgId
    name: str
    base: bytes
    before: frozenset[DeviceRule]
    after: frozenset[DeviceRule]
    code: bytes


def _plan(
    info: syscall.ProgInfo, update: Callable[[frozenset[DeviceRule]], frozenset[DeviceRule]]
) -> _Plan | None:
    before = asm.prefix_devices(info.xlated)
    after = update(before)
    if after == before:
        return None
    base = asm.strip_prefix(info.xlated)
    return _Plan(
        old_id=info.id,
        name=info.name or _DEFAULT_PROG_NAME,
        base=base,
        before=before,
        after=after,
        code=asm.add_prefix(after, base),
    )


def _roll_back(
    cgroup: Fd,
    flags: AttachFlags,
    undo: Sequence[tuple[Fd, Fd]],
    *,
    cgroup_dir: Path,
    cause: CgroupV2Error,
) -> None:
    """Put the original programs back, newest swap first; ``undo`` is (ours, original)."""
    for ours, original in undo:
        try:
            _swap(cgroup, flags, current=ours, new=original, cgroup_dir=cgroup_dir)
        except CgroupV2Error as error:
            raise RollbackError(
                f"could not restore the device programs at {cgroup_dir} after a failed "
                f"change ({cause}); some of them still carry the change: {error}"
            ) from error


def _verify(
    cgroup: Fd, before: syscall.QueryResult, plans: Sequence[_Plan], change: GrantChange
) -> None:
    """Read the directory back: our programs in the old ones' places, with the intended code.

    Compared semantically (the original part and the granted set) rather than
    byte for byte, so a kernel that rewrites some instruction on load in the
    same way each time does not turn a correct grant into an error.
    """
    path = change.cgroup_dir
    replaced = {swap.old_id: swap.new_id for swap in change.swaps}
    expected = tuple(replaced.get(prog_id, prog_id) for prog_id in before.prog_ids)
    try:
        actual = _query(cgroup, path).prog_ids
        if actual != expected:
            raise VerificationError(
                f"device programs at {path} are {list(actual)} after the swap, "
                f"expected {list(expected)}",
                change,
            )
        for swap, plan in zip(change.swaps, plans, strict=True):
            with _open_program(swap.new_id, path) as program:
                xlated = _read_program(program, swap.new_id, path).xlated
            if asm.strip_prefix(xlated) != plan.base or asm.prefix_devices(xlated) != plan.after:
                raise VerificationError(
                    f"device program {swap.new_id} at {path} does not hold what we loaded:\n"
                    f"{asm.disassemble(xlated)}",
                    change,
                )
    except VerificationError:
        raise
    except CgroupV2Error as error:
        raise VerificationError(f"cannot verify the change at {path}: {error}", change) from error


def _apply_once(
    path: Path,
    requested: frozenset[DeviceRule],
    update: Callable[[frozenset[DeviceRule]], frozenset[DeviceRule]],
    leave: Collection[str],
) -> GrantChange:
    with ExitStack() as stack:
        cgroup = stack.enter_context(_open_cgroup(path))
        state = _query(cgroup, path)
        if not state.prog_ids:
            return GrantChange(path, requested, swaps=(), restricted=False)
        plans: list[_Plan] = []
        originals: list[Fd] = []
        for prog_id in state.prog_ids:
            program = stack.enter_context(_open_program(prog_id, path))
            info = _read_program(program, prog_id, path)
            plan = None if info.name in leave else _plan(info, update)
            if plan is not None:
                plans.append(plan)
                originals.append(program)
        if not plans:
            return GrantChange(path, requested, swaps=(), restricted=True)
        if AttachFlags.ALLOW_MULTI in state.attach_flags:
            _require_replace()
        # Load everything before swapping anything: a program the verifier refuses
        # then fails the whole operation with the directory untouched.
        loaded = [
            stack.enter_context(
                _load(plan.code, name=plan.name, what=f"patched program {plan.old_id}")
            )
            for plan in plans
        ]
        new_ids = [_loaded_id(program) for program in loaded]
        undo: list[tuple[Fd, Fd]] = []
        try:
            for original, ours in zip(originals, loaded, strict=True):
                _swap(cgroup, state.attach_flags, current=original, new=ours, cgroup_dir=path)
                undo.insert(0, (ours, original))
        except CgroupV2Error as error:
            _roll_back(cgroup, state.attach_flags, undo, cgroup_dir=path, cause=error)
            raise
        change = GrantChange(
            path,
            requested,
            swaps=tuple(
                ProgramSwap(plan.old_id, new_id, plan.before, plan.after)
                for plan, new_id in zip(plans, new_ids, strict=True)
            ),
            restricted=True,
        )
        _verify(cgroup, state, plans, change)
        return change


def _apply(
    cgroup_dir: str | Path,
    requested: frozenset[DeviceRule],
    update: Callable[[frozenset[DeviceRule]], frozenset[DeviceRule]],
    leave: Collection[str] = (),
) -> GrantChange:
    path = Path(cgroup_dir)
    attempt = 1
    while True:
        try:
            change = _apply_once(path, requested, update, leave)
        except ConcurrentModificationError as error:
            if attempt == _ATTEMPTS:
                raise
            log.info("device programs at %s changed under us, starting over: %s", path, error)
            attempt += 1
            continue
        for swap in change.swaps:
            log.info(
                "device program at %s: %d -> %d, granted %s -> %s",
                path,
                swap.old_id,
                swap.new_id,
                _render(swap.before),
                _render(swap.after),
            )
        return change


def _render(devices: frozenset[DeviceRule]) -> str:
    return "[" + ", ".join(sorted(rule.render_v1() for rule in devices)) + "]"


def grant(
    cgroup_dir: str | Path, devices: Collection[DeviceRule], *, leave: Collection[str] = ()
) -> GrantChange:
    """Allow ``devices`` (allow rules) through every device program attached at the directory.

    Granting what is already granted changes nothing; with no device program
    attached there is nothing to change (``restricted`` is False in the result).
    Programs named in ``leave`` are not patched: systemd's own, which it rebuilds from the
    unit's ``DeviceAllow=`` (:mod:`..systemd_units`) and detaches by id — a patched copy
    would stay attached beside every program it builds later.
    """
    added = frozenset(devices)
    return _apply(cgroup_dir, added, lambda current: current | added, leave)


def revoke(cgroup_dir: str | Path, devices: Collection[DeviceRule]) -> GrantChange:
    """Take back exactly the rules in ``devices`` that :func:`grant` added (set difference).

    Revoking what was never granted changes nothing. When the last rule goes,
    the program in place is again the original, instruction for instruction.
    """
    removed = frozenset(devices)
    return _apply(cgroup_dir, removed, lambda current: current - removed)


# ---- queries and the runtime's part ---------------------------------------------------------


def attached_programs(cgroup_dir: str | Path) -> list[ProgramInfo]:
    """The device programs attached at the directory (not its ancestors), in run order."""
    path = Path(cgroup_dir)
    with _open_cgroup(path) as cgroup:
        prog_ids = _query(cgroup, path).prog_ids
    programs = []
    for prog_id in prog_ids:
        with _open_program(prog_id, path) as program:
            info = _read_program(program, prog_id, path)
        programs.append(
            ProgramInfo(
                id=info.id,
                name=info.name,
                insn_count=len(info.xlated) // asm.INSN_SIZE,
                granted=asm.prefix_devices(info.xlated),
                code=info.xlated,
            )
        )
    return programs


def granted_devices(
    cgroup_dir: str | Path, *, leave: Collection[str] = ()
) -> frozenset[DeviceRule]:
    """The devices our prefixes grant on *every* program at the directory (all must allow),
    not counting programs named in ``leave`` (see :func:`grant`).

    Empty when no program is attached: then nothing was granted here — and
    nothing needed to be (see :attr:`GrantChange.restricted`).
    """
    programs = [p for p in attached_programs(cgroup_dir) if p.name not in leave]
    if not programs:
        return frozenset()
    return frozenset.intersection(*(program.granted for program in programs))


def attach_device_program(
    cgroup_dir: str | Path,
    rules: Sequence[DeviceRule],
    *,
    default_allow: bool = False,
    name: str = "gpu_hotplug_dev",
) -> ProgId:
    """Attach a runc-style program for ``rules`` (first match wins) with ``ALLOW_MULTI``.

    What a container runtime does when it starts a container; local mode's
    sandboxes use it to start from "no GPU". Returns the new program's id.
    """
    path = Path(cgroup_dir)
    code = asm.build_device_program(rules, default_allow=default_allow)
    with _open_cgroup(path) as cgroup, _load(code, name=name, what="a device program") as program:
        _query(cgroup, path)  # a clear NotCgroup2Error before the attach's plain EBADF
        prog_id = _loaded_id(program)
        try:
            syscall.prog_attach(cgroup, program, flags=AttachFlags.ALLOW_MULTI)
        except BpfError as error:
            raise _translate(error, f"attaching a device program at {path}") from error
    log.info("attached device program %d at %s", prog_id, path)
    return prog_id


def detach_program(cgroup_dir: str | Path, prog_id: ProgId) -> bool:
    """Detach a program *we* attached; False when it is not attached there (any more).

    For cleanup only: detaching someone else's device program would open every
    device it denies.
    """
    path = Path(cgroup_dir)
    with _open_cgroup(path) as cgroup:
        if prog_id not in _query(cgroup, path).prog_ids:
            return False
        try:
            program = syscall.prog_get_fd_by_id(prog_id)
        except BpfError as error:
            if error.errno == errno.ENOENT:
                return False
            raise _translate(error, f"opening device program {prog_id}") from error
        with program:
            try:
                syscall.prog_detach(cgroup, program)
            except BpfError as error:
                if error.errno == errno.ENOENT:
                    return False
                raise _translate(error, f"detaching device program {prog_id} at {path}") from error
    log.info("detached device program %d at %s", prog_id, path)
    return True
