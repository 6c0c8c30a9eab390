"""Where a process's cgroups are on this host: inspection only, never a write.

Why this module exists: every device grant starts from "which cgroup directory
governs this process?", and the answer must come from the kernel, not from
names. A container's cgroup path is read from ``/proc/<pid>/cgroup`` and joined
to the mount point the kernel reports in ``mountinfo`` — never built from a pod
uid or container id — and a path that would leave its hierarchy (``..``, which
the kernel prints for cgroups outside the reader's cgroup namespace, or a
symlink) is refused. The layouts it understands are the three a node can have:
pure v1 (no cgroup2 mounted), hybrid (v1 controllers plus cgroup2 at
``/sys/fs/cgroup/unified``) and pure v2 (cgroup2 at ``/sys/fs/cgroup``).

Parsing functions take text, so tests feed fixtures; the functions that read
take the proc root (``/proc`` by default, e.g. ``/host/proc`` in an agent pod)
and the caller can rebase mount points onto where the host's ``/sys`` is seen.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Final, Literal

DEVICES_CONTROLLER = "devices"
_PROC = Path("/proc")

# mountinfo escapes space, tab, newline and backslash as \ooo (fs/proc_namespace.c).
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


class CgroupError(Exception):
    """Base of this module's errors: the cgroup of a process could not be determined."""


class CgroupPathError(CgroupError):
    """A cgroup path read from the kernel would lead outside its hierarchy."""


class CgroupLimitError(CgroupError):
    """A container has more cgroups below it than a walk visits (``MAX_DESCENDANTS``)."""


class CgroupNotFoundError(CgroupError):
    """The process, its cgroup entry, the hierarchy's mount or the directory is missing."""


_DIRECTORY_CACHE: Final = 4096
"""How many accepted cgroup paths ``CgroupMount.directory_of`` remembers (then forgets all:
containers come and go, and a full cache means most of its entries are gone)."""
_DIRECTORIES: dict[tuple[Path, PurePosixPath, str], Path] = {}


@dataclass(frozen=True)
class CgroupMount:
    """One mount of a cgroup hierarchy, as ``mountinfo`` describes it."""

    mount_point: Path
    """Where the hierarchy is mounted (rebased when the host's /sys is seen elsewhere)."""
    root: PurePosixPath
    """Which cgroup of the hierarchy the mount shows (``/`` unless mounted from a subtree)."""

    def directory_of(self, cgroup_path: str) -> Path:
        """The directory of ``cgroup_path`` (as ``/proc/<pid>/cgroup`` shows it) in this mount.

        Refuses anything that would resolve outside the mount point: ``..`` or ``.``
        components, a relative path, a path outside the mounted subtree, a symlink.

        Remembered (``_DIRECTORIES``): the engine and the resolver ask for a container's
        directories several times per attach and detach, and the symlink check (a
        ``realpath`` walk, ≈ 0.06 ms) was a tenth of an attach's CPU. Only accepted paths are
        kept, and what the check found cannot change while the hierarchy stays mounted: a
        cgroup filesystem has no symlinks and refuses ``symlink(2)`` (kernfs), so a path
        below its mount point that resolved inside once resolves inside for good. Refusals
        are never remembered: a bad path is checked, and refused, every time.
        """
        key = (self.mount_point, self.root, cgroup_path)
        directory = _DIRECTORIES.get(key)
        if directory is None:
            directory = self._checked_directory(cgroup_path)
            if len(_DIRECTORIES) >= _DIRECTORY_CACHE:
                _DIRECTORIES.clear()
            _DIRECTORIES[key] = directory
        return directory

    def _checked_directory(self, cgroup_path: str) -> Path:
        """``directory_of`` without the memory: every check made."""
        path = PurePosixPath(cgroup_path)
        if not path.is_absolute() or any(part in (".", "..") for part in cgroup_path.split("/")):
            raise CgroupPathError(
                f"cgroup path {cgroup_path!r} is not a plain absolute path; a '..' means the "
                "cgroup is outside the reader's cgroup namespace"
            )
        if "\0" in cgroup_path:
            raise CgroupPathError(f"cgroup path {cgroup_path!r} contains a NUL byte")
        try:
            relative = path.relative_to(self.root)
        except ValueError as e:
            raise CgroupPathError(
                f"cgroup {cgroup_path!r} is not visible through the mount at {self.mount_point} "
                f"(which shows only {self.root})"
            ) from e
        directory = self.mount_point / relative
        resolved = directory.resolve()
        if not resolved.is_relative_to(self.mount_point.resolve()):
            raise CgroupPathError(
                f"cgroup directory {directory} resolves to {resolved}, outside {self.mount_point}"
            )
        return directory


@dataclass(frozen=True)
class CgroupHierarchies:
    """The two hierarchies that govern device access, as mounted on one host."""

    devices_v1: CgroupMount | None
    """The v1 ``devices`` controller (pure v1 and hybrid hosts)."""
    unified: CgroupMount | None
    """The cgroup2 hierarchy, whose eBPF device programs also apply (hybrid and pure v2)."""

    @property
    def layout(self) -> Literal["v1", "hybrid", "v2", "none"]:
        """A name for logs and for choosing backends: which device controllers apply."""
        if self.devices_v1 is not None:
            return "hybrid" if self.unified is not None else "v1"
        return "v2" if self.unified is not None else "none"

    def rebased(self, prefix: Path) -> CgroupHierarchies:
        """The same hierarchies seen under ``prefix`` (e.g. ``/host`` where a pod mounts
        the host's ``/sys`` at ``/host/sys``, or ``tmp_path`` in tests)."""

        def move(mount: CgroupMount | None) -> CgroupMount | None:
            if mount is None:
                return None
            return replace(mount, mount_point=prefix / mount.mount_point.relative_to("/"))

        return CgroupHierarchies(devices_v1=move(self.devices_v1), unified=move(self.unified))


@dataclass(frozen=True)
class ProcCgroupPaths:
    """The raw paths one ``/proc/<pid>/cgroup`` file names, before any mount is applied."""

    devices_v1: str | None
    unified: str | None


@dataclass(frozen=True)
class ProcessCgroups:
    """The cgroup directories that govern one process's device access, as absolute paths."""

    pid: int
    devices_v1: Path | None
    unified: Path | None


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), field)


def parse_mountinfo(text: str) -> CgroupHierarchies:
    """Find the v1 ``devices`` mount and the cgroup2 mount in ``mountinfo`` text.

    A later mount on the same mount point hides an earlier one (mountinfo lists
    mounts in the order they were made); when a hierarchy is mounted several times,
    a mount of its root (``/``) is preferred over one of a subtree.
    """
    visible: dict[str, tuple[str, CgroupMount]] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        separator = fields.index("-", 6) if "-" in fields[6:] else -1
        if separator < 0 or len(fields) < separator + 4:
            raise ValueError(f"unparseable mountinfo line {line!r}")
        fstype, super_options = fields[separator + 1], fields[separator + 3]
        mount = CgroupMount(
            mount_point=Path(_unescape(fields[4])), root=PurePosixPath(_unescape(fields[3]))
        )
        if fstype == "cgroup2":
            visible[str(mount.mount_point)] = ("unified", mount)
        elif fstype == "cgroup" and DEVICES_CONTROLLER in super_options.split(","):
            visible[str(mount.mount_point)] = ("devices", mount)
        else:
            visible.pop(str(mount.mount_point), None)

    def pick(kind: str) -> CgroupMount | None:
        mounts = [mount for found, mount in visible.values() if found == kind]
        mounts.sort(key=lambda mount: mount.root != PurePosixPath("/"))  # stable: root first
        return mounts[0] if mounts else None

    return CgroupHierarchies(devices_v1=pick("devices"), unified=pick("unified"))


def parse_proc_cgroup(text: str) -> ProcCgroupPaths:
    """The ``devices`` (v1) and unified (v2, ``0::``) paths of one ``/proc/<pid>/cgroup``."""
    devices: str | None = None
    unified: str | None = None
    for line in text.splitlines():
        if not line:
            continue
        parts = line.split(":", 2)
        if len(parts) != 3:
            raise ValueError(f"unparseable /proc/<pid>/cgroup line {line!r}")
        hierarchy_id, controllers, path = parts
        if hierarchy_id == "0" and controllers == "":
            unified = path
        elif DEVICES_CONTROLLER in controllers.split(","):
            devices = path
    return ProcCgroupPaths(devices_v1=devices, unified=unified)


def discover(
    *,
    host_proc: Path = _PROC,
    pid: int | Literal["self"] = "self",
    rebase: Path | None = None,
) -> CgroupHierarchies:
    """Read which cgroup hierarchies are mounted, from ``<host_proc>/<pid>/mountinfo``.

    ``pid`` picks whose mount namespace is asked (``1`` for the host's when the agent
    runs in its own); ``rebase`` is where that namespace's ``/`` is visible to us.
    """
    path = host_proc / str(pid) / "mountinfo"
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise CgroupNotFoundError(f"cannot read {path}: is {host_proc} a procfs?") from e
    hierarchies = parse_mountinfo(text)
    return hierarchies if rebase is None else hierarchies.rebased(rebase)


def process_cgroups(
    pid: int, *, hierarchies: CgroupHierarchies, host_proc: Path = _PROC
) -> ProcessCgroups:
    """The device-relevant cgroup directories of ``pid``, read from ``/proc/<pid>/cgroup``.

    A hierarchy that is not mounted yields ``None``; a process without an entry in a
    mounted hierarchy, or whose path leaves it, is an error.
    """
    path = host_proc / str(pid) / "cgroup"
    try:
        paths = parse_proc_cgroup(path.read_text())
    except (FileNotFoundError, ProcessLookupError) as e:
        raise CgroupNotFoundError(f"process {pid} is gone ({path} unreadable)") from e

    def locate(mount: CgroupMount | None, cgroup_path: str | None, what: str) -> Path | None:
        if mount is None:
            return None
        if cgroup_path is None:
            raise CgroupNotFoundError(f"{path} has no {what} entry, but that hierarchy is mounted")
        return mount.directory_of(cgroup_path)

    return ProcessCgroups(
        pid=pid,
        devices_v1=locate(hierarchies.devices_v1, paths.devices_v1, "devices (v1)"),
        unified=locate(hierarchies.unified, paths.unified, "unified (0::)"),
    )


def cgroup_dirs_to_patch_v2(leaf: Path, *, scope: Path) -> list[Path]:
    """The cgroup2 directories whose device programs must allow a device, leaf first.

    Rule: every directory from ``leaf`` up to and including ``scope``. In cgroup2 all
    programs on a task's cgroup and its ancestors must allow an access, so a grant
    has to reach each one that can carry a program; ``scope`` is the topmost one the
    container owns (its runtime's cgroupsPath: crun puts the process one level
    deeper, in ``<scope>/container``, and attaches the program to the scope). Above
    it live the pod and the host, which are not ours to change.
    """
    for path in (leaf, scope):
        if not path.is_absolute() or ".." in path.parts:
            raise ValueError(f"cgroup directory {path} must be absolute and free of '..'")
    if leaf != scope and scope not in leaf.parents:
        raise ValueError(f"scope {scope} is not {leaf} or one of its ancestors")
    directories = [leaf]
    while directories[-1] != scope:
        directories.append(directories[-1].parent)
    return directories


MAX_DESCENDANTS: Final = 65_536
"""The most cgroups a walk below one container visits. A container may make cgroups below
its own at will (1,200 nested ones broke a recursive walk); a walk that would visit more
fails with :class:`CgroupLimitError`, so a hostile container costs a bounded amount of work
and never the agent's stack."""


def descendants(directory: Path, *, limit: int = MAX_DESCENDANTS) -> list[Path]:
    """Every cgroup below ``directory`` (not itself), parents before their children.

    v1 ``devices.allow`` does not propagate to existing child cgroups, so a grant
    must be written to each of them, and a child can only be given what its parent
    has — hence the top-down order. A child removed while we walk is skipped; the
    top directory missing is an error. The walk is iterative (any depth) and visits at
    most ``limit`` cgroups (:class:`CgroupLimitError` beyond).
    """
    if not directory.is_dir():
        raise CgroupNotFoundError(f"cgroup directory {directory} does not exist")
    found: list[Path] = []
    pending = list(reversed(_child_dirs(directory)))  # a stack: depth first, in name order
    while pending:
        current = pending.pop()
        found.append(current)
        if len(found) > limit:
            raise CgroupLimitError(
                f"more than {limit} cgroups below {directory}; refusing to walk them all"
            )
        pending += reversed(_child_dirs(current))
    return found


def _child_dirs(directory: Path) -> list[Path]:
    try:
        with os.scandir(directory) as entries:
            names = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []  # removed while we walk
    except OSError as e:
        raise CgroupError(f"cannot list cgroup {directory}: {e.strerror}") from e
    return [directory / name for name in names]


def pids_in_cgroup(directory: Path, *, recursive: bool = True) -> list[int]:
    """The processes (thread-group ids, as the reader's pid namespace numbers them) in
    ``directory`` and, when ``recursive``, in every cgroup below it; sorted, unique."""
    directories = [directory, *descendants(directory)] if recursive else [directory]
    pids: set[int] = set()
    for index, current in enumerate(directories):
        procs = current / "cgroup.procs"
        try:
            text = procs.read_text()
        except OSError as e:
            if index > 0 and e.errno == errno.ENOENT:
                continue  # a child cgroup removed since we listed it
            raise CgroupNotFoundError(f"cannot read {procs}: {e.strerror}") from e
        pids.update(int(token) for token in text.split())
    return sorted(pids)
