"""The cgroup v1 ``devices`` controller of one cgroup: set a policy, grant, revoke —
and prove every change by reading back what the kernel enforces.

Why this module exists: on v1 (and hybrid) hosts a device is usable by a
container only if its cgroup's ``devices.list`` allows it. The kernel's rules
have traps that a plain "write and hope" misses (security/device_cgroup.c):

- an allow is not inherited by *existing* child cgroups, so a grant is written
  to the cgroup and every descendant, parents first (a child can never be given
  more than its parent has);
- a deny does propagate down, but it only clears an entry with exactly the same
  pattern: under ``c 195:* rwm`` or ``a *:* rwm`` a specific deny is accepted and
  changes nothing. A revocation that is a silent no-op must never be reported as
  done, so every change is verified against ``devices.list`` with the shared
  policy model (:mod:`.devrules`) and fails loudly on a mismatch.

Why apart from :mod:`.device_controllers.v1` (two layers, not one concern split): this is the
kernel's ``devices`` file protocol on one cgroup, shared by both products of :mod:`.linux` —
the sandbox runtime sets a fresh sandbox's whole policy with :func:`set_policy`, the hot-plug
engine grants and revokes through :mod:`.device_controllers.v1`. That controller is the
engine's own policy on top (which devices need a write at all, the journal's undo of each, the
verdicts the engine compares across hierarchies); folding it in here would make the sandbox
runtime import the engine's journal, which an import-linter contract forbids.

All reads and writes of control files go through one small seam
(:class:`ControlFiles`); the real one (:class:`CgroupFS`) opens each file beneath
its cgroup directory without following symlinks and checks the directory is on a
cgroup v1 filesystem, and tests inject their own.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from . import cgroups
from ._sys import (
    CGROUP_SUPER_MAGIC,
    RESOLVE_BENEATH,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
    fs_type,
    openat2,
)
from .devrules import (
    ALL_ACCESS,
    RW,
    Access,
    CharDevice,
    DeviceRule,
    DevType,
    effective_access,
    parse_v1_list,
    v1_allow_list,
)

ALLOW_FILE: Final = "devices.allow"
DENY_FILE: Final = "devices.deny"
LIST_FILE: Final = "devices.list"


@dataclass(frozen=True)
class Write:
    """One line written to one control file."""

    path: Path
    data: str


@dataclass(frozen=True)
class V1Change:
    """What an operation wrote, in order: for the caller's log and its roll-back."""

    writes: tuple[Write, ...]


class CgroupV1Error(Exception):
    """Base of this module's errors. ``done`` lists the writes that did succeed before
    the failure (they are not undone here: the caller owns the roll-back)."""

    def __init__(self, message: str, *, done: tuple[Write, ...] = ()) -> None:
        super().__init__(message)
        self.done = done


class ControlFileError(CgroupV1Error):
    """The kernel (or the filesystem) refused a read or write of a control file."""

    def __init__(
        self, path: Path, data: str | None, cause: OSError, *, done: tuple[Write, ...]
    ) -> None:
        action = f"writing {data!r} to" if data is not None else "reading"
        name = errno.errorcode.get(cause.errno or 0, "?")
        super().__init__(f"{action} {path} failed: {cause.strerror} ({name})", done=done)
        self.path = path
        self.data = data


class VerificationError(CgroupV1Error):
    """After the writes, ``devices.list`` does not show what they should have made."""


class WildcardAllowError(VerificationError):
    """A revocation is a no-op because a wildcard entry still allows the device."""


class ControlFiles(Protocol):
    """The seam to cgroupfs: read or write a whole control file, raising ``OSError``."""

    def read(self, path: Path) -> str: ...

    def write(self, path: Path, data: str) -> None: ...


@dataclass(frozen=True)
class CgroupFS:
    """The real control files, each opened beneath its cgroup directory.

    The directory must be on a filesystem whose magic is ``fs_magic`` (a cgroup v1
    hierarchy unless a test passes ``None`` for a plain directory) and the file is
    opened with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV``, so
    a misconfigured path can never turn a rule into a write elsewhere.
    """

    fs_magic: int | None = CGROUP_SUPER_MAGIC

    def read(self, path: Path) -> str:
        fd = self._open(path, os.O_RDONLY)
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks).decode()

    def write(self, path: Path, data: str) -> None:
        # One rule per write(2): the kernel parses each write as a single rule.
        payload = data.encode()
        fd = self._open(path, os.O_WRONLY)
        try:
            if os.write(fd, payload) != len(payload):
                raise OSError(errno.EIO, "short write to a control file", str(path))
        finally:
            os.close(fd)

    def _open(self, path: Path, flags: int) -> int:
        dirfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if self.fs_magic is not None and (found := fs_type(dirfd)) != self.fs_magic:
                raise OSError(
                    errno.EMEDIUMTYPE,
                    f"not a cgroup v1 hierarchy (filesystem magic {found:#x})",
                    str(path.parent),
                )
            resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV
            return openat2(dirfd, path.name, flags, resolve=resolve)
        finally:
            os.close(dirfd)


HOST_FILES: Final = CgroupFS()
"""The control files of this host's v1 hierarchies."""


class _Journal:
    """Performs writes through the seam and remembers the ones that succeeded."""

    def __init__(self, files: ControlFiles) -> None:
        self.files = files
        self.done: list[Write] = []

    def write(self, path: Path, data: str) -> None:
        try:
            self.files.write(path, data)
        except OSError as e:
            raise ControlFileError(path, data, e, done=tuple(self.done)) from e
        self.done.append(Write(path, data))

    def read_list(self, cgroup_dir: Path) -> tuple[str, list[DeviceRule]]:
        path = cgroup_dir / LIST_FILE
        try:
            text = self.files.read(path)
        except OSError as e:
            raise ControlFileError(path, None, e, done=tuple(self.done)) from e
        try:
            return text, parse_v1_list(text)
        except ValueError as e:
            raise VerificationError(f"{path}: {e}", done=tuple(self.done)) from e

    def change(self) -> V1Change:
        return V1Change(writes=tuple(self.done))


def _vanished_child(error: ControlFileError, directory: Path, top: Path) -> bool:
    """Whether a failed access may be skipped: only ENOENT on a *descendant*, meaning
    that child cgroup was removed while we worked. A removed cgroup holds no process,
    so it needs no grant; the top directory missing is always an error."""
    cause = error.__cause__
    return directory != top and isinstance(cause, OSError) and cause.errno == errno.ENOENT


def _render(rules: Iterable[DeviceRule]) -> str:
    return ", ".join(repr(rule.render_v1()) for rule in rules) or "nothing"


def read_allow_list(cgroup_dir: Path, *, files: ControlFiles = HOST_FILES) -> list[DeviceRule]:
    """The allow list the kernel enforces for ``cgroup_dir`` (its ``devices.list``)."""
    return _Journal(files).read_list(cgroup_dir)[1]


def allowed(cgroup_dir: Path, device: CharDevice, *, files: ControlFiles = HOST_FILES) -> Access:
    """The access ``cgroup_dir`` grants to ``device`` right now."""
    rules = read_allow_list(cgroup_dir, files=files)
    return effective_access(rules, DevType.CHAR, device.major, device.minor)


def set_policy(
    cgroup_dir: Path, rules: Sequence[DeviceRule], *, files: ControlFiles = HOST_FILES
) -> V1Change:
    """Give a fresh cgroup exactly ``rules``, as a container runtime does at creation.

    Writes ``a`` to ``devices.deny`` (allow-list mode, empty list), then each rule in
    order (allow rules to ``devices.allow``, deny rules to ``devices.deny``), and
    checks that ``devices.list`` then equals what the rules should produce. The
    kernel refuses the mode switch (EINVAL) once the cgroup has children, so this is
    for a cgroup that has none yet.
    """
    expected = v1_allow_list(rules)  # also refuses type-'a' rules, which switch modes
    journal = _Journal(files)
    journal.write(cgroup_dir / DENY_FILE, "a")
    for rule in rules:
        journal.write(cgroup_dir / (ALLOW_FILE if rule.allow else DENY_FILE), rule.render_v1())
    text, actual = journal.read_list(cgroup_dir)
    if set(actual) != set(expected):
        raise VerificationError(
            f"{cgroup_dir / LIST_FILE} shows {text.strip()!r} after setting the policy; "
            f"expected {_render(expected)}",
            done=journal.change().writes,
        )
    return journal.change()


def grant(
    cgroup_dir: Path,
    devices: Iterable[CharDevice],
    *,
    access: Access = RW,
    recursive: bool = True,
    files: ControlFiles = HOST_FILES,
) -> V1Change:
    """Allow ``devices`` in ``cgroup_dir`` and, when ``recursive``, every cgroup below it.

    Allow entries are not inherited by existing children (crun, for one, runs the
    process in ``<scope>/container``), so each directory gets its own write, parents
    first. Every written directory is then checked to grant at least ``access``.
    The inverse is :func:`revoke` on ``cgroup_dir`` (a deny propagates down).
    """
    wanted = list(devices)
    journal = _Journal(files)
    for device in wanted:
        journal.write(cgroup_dir / ALLOW_FILE, device.rule(access).render_v1())
    directories = [cgroup_dir]
    if recursive:
        try:
            directories += cgroups.descendants(cgroup_dir)
        except cgroups.CgroupError as e:
            raise CgroupV1Error(str(e), done=journal.change().writes) from e
    granted: list[Path] = [cgroup_dir]
    for directory in directories[1:]:
        try:
            for device in wanted:
                journal.write(directory / ALLOW_FILE, device.rule(access).render_v1())
        except ControlFileError as e:
            if not _vanished_child(e, directory, cgroup_dir):
                raise
            continue
        granted.append(directory)
    for directory in granted:
        _verify_granted(journal, directory, cgroup_dir, wanted, access)
    return journal.change()


def _verify_granted(
    journal: _Journal, directory: Path, top: Path, devices: Sequence[CharDevice], access: Access
) -> None:
    try:
        text, rules = journal.read_list(directory)
    except ControlFileError as e:
        if _vanished_child(e, directory, top):
            return
        raise
    for device in devices:
        has = effective_access(rules, DevType.CHAR, device.major, device.minor)
        if has & access != access:
            raise VerificationError(
                f"{device} should now have {access.render()!r} in {directory}, but "
                f"{LIST_FILE} grants {has.render() or 'nothing'} (list: {text.strip()!r})",
                done=journal.change().writes,
            )


def revoke(
    cgroup_dir: Path,
    devices: Iterable[CharDevice],
    *,
    access: Access = ALL_ACCESS,
    files: ControlFiles = HOST_FILES,
) -> V1Change:
    """Deny ``devices`` in ``cgroup_dir``; the kernel propagates a deny to every child.

    Then ``cgroup_dir`` and each descendant must no longer allow any revoked bit.
    A wildcard entry that still grants read or write (``c 195:* rwm``, ``a *:* rwm``)
    makes the deny a silent no-op: that raises :class:`WildcardAllowError`. A
    wildcard granting only ``m`` (every container's ``c *:* m``) is accepted —
    mknod permission alone opens nothing.
    Processes that opened the device before keep their fds: that is the busy
    check's concern, not this one.
    """
    wanted = list(devices)
    journal = _Journal(files)
    for device in wanted:
        journal.write(cgroup_dir / DENY_FILE, device.rule(access).render_v1())
    try:
        directories = [cgroup_dir, *cgroups.descendants(cgroup_dir)]
    except cgroups.CgroupError as e:
        raise CgroupV1Error(str(e), done=journal.change().writes) from e
    for directory in directories:
        _verify_revoked(journal, directory, cgroup_dir, wanted, access)
    return journal.change()


def _verify_revoked(
    journal: _Journal, directory: Path, top: Path, devices: Sequence[CharDevice], access: Access
) -> None:
    try:
        text, rules = journal.read_list(directory)
    except ControlFileError as e:
        if _vanished_child(e, directory, top):
            return
        raise
    for device in devices:
        still = [
            rule
            for rule in rules
            if rule.covers(DevType.CHAR, device.major, device.minor) and rule.access & access
        ]
        wildcards = [rule for rule in still if rule.is_wildcard and rule.access & access & RW]
        if wildcards:
            raise WildcardAllowError(
                f"revoking {device} in {top} is a no-op: {directory / LIST_FILE} still allows "
                f"it through {_render(wildcards)}, and a deny cannot punch a hole in a "
                "wildcard allow ('a *:* rwm' means the cgroup is not confined at all); "
                "the device stays usable",
                done=journal.change().writes,
            )
        specific = [rule for rule in still if not rule.is_wildcard]
        if specific:
            raise VerificationError(
                f"{device} is still allowed in {directory} after the deny: "
                f"{_render(specific)} (list: {text.strip()!r})",
                done=journal.change().writes,
            )
