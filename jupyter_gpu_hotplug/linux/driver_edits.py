"""The driver's user space in a running container: a CDI spec's mounts, links and ldcache.

Why this module exists: device nodes and a cgroup rule make a GPU *openable*; CUDA also needs the
driver's libraries (``libcuda.so.1``, ``libnvidia-ml.so.1``), its tools (``nvidia-smi``) and a
loader that finds them. A container started with a GPU gets them from the runtime (the NVIDIA
Container Toolkit, applying the node's CDI spec); one started without — a CPU notebook — has
none. :func:`apply` gives a running container what the spec gives a new one, :func:`remove`
takes back exactly what :func:`apply` added.

What is applied, and how (``edits`` is :class:`.cdi_spec.ContainerEdits`, chosen by the agent
from the node's spec for the GPU it allocated, never by a caller):

- **mounts**: read-only bind mounts from the host's driver root (:mod:`.bindmounts`); a mount
  already there (the runtime's, in NVIDIA's legacy mode) is left as it is and never taken back;
- **links**: the library's SONAME links (``libcuda.so.1 -> libcuda.so.550.54.15``) as the host's
  driver root has them beside each mounted library, and the links the spec's
  ``create-symlinks`` hooks name; made only where nothing is, removed only while still the same;
- **ldcache**: the spec's ``update-ldcache`` hook, done as the toolkit does it — the host's
  ``ldconfig`` run with the container's root as its root (``-r``), ``-X`` so that it only writes
  the cache (the links are ours to account for, above); run again after a removal;
- **environment**: not applicable to processes that are running (Linux has no way to change
  another process's environment); the NVIDIA spec's only variable, ``NVIDIA_VISIBLE_DEVICES``,
  is for the runtime's own hook and means nothing to CUDA. Returned as
  :attr:`Applied.env_not_applied`;
- **other hooks** (``enable-cuda-compat``: forward-compatibility libraries that a simulated or
  a current driver does not need; ``disable-device-node-modification``: a ``params`` file that
  stops the driver making nodes in the container, irrelevant to nodes made from outside) are
  listed in :attr:`Applied.hooks_skipped`, never run — the agent runs no binary named by a file.

Crash safety: before anything is changed, what will be made is written to ``record`` (one JSON
file per container, fsync-ed, renamed into place); :func:`remove` reads it and undoes only what is
still there and still the same, so a ``kill -9`` at any point between two syscalls leaves
nothing that the next :func:`remove` cannot find. The record is the agent's, in its state
directory, never in the container.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final

from . import bindmounts, procfs
from ._sys import RESOLVE_IN_ROOT, openat2
from .bindmounts import DIRECTORIES, BindMount, MountError
from .cdi_spec import ContainerEdits, Hook

__all__ = [
    "LIBCUDA",
    "Applied",
    "DriverEditsError",
    "apply",
    "container_has_library",
    "provides_library",
    "remove",
]

log = logging.getLogger(__name__)

LIBCUDA: Final = "libcuda.so.1"
"""What ``torch.cuda`` and every CUDA program ``dlopen``s first."""
LDCONFIG_TIMEOUT: Final = 60.0
_HOOK_PROGRAMS: Final = frozenset({"nvidia-cdi-hook", "nvidia-ctk"})
_LINK_HOOK: Final = "create-symlinks"
_LDCACHE_HOOK: Final = "update-ldcache"
_SKIPPED_HOOKS: Final = frozenset({"enable-cuda-compat", "disable-device-node-modification"})
_LIBRARY_DIRS: Final = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/local/nvidia/lib64",
)
"""Where a container's loader finds a driver library without a cache entry (Debian, RHEL, and
the NVIDIA legacy device plugin's path)."""
_CACHE_FILES: Final = ("/etc/ld.so.cache",)
_CACHE_LIMIT: Final = 16 * 2**20


class DriverEditsError(Exception):
    """Applying or removing the driver's edits failed; :func:`apply` has undone its part."""


@dataclass(frozen=True)
class Applied:
    """What :func:`apply` changed, and what it could not give a running process."""

    mounts: tuple[PurePosixPath, ...]
    links: tuple[PurePosixPath, ...]
    ldcache: bool
    env_not_applied: tuple[str, ...]
    hooks_skipped: tuple[str, ...]


@dataclass(frozen=True)
class _Plan:
    mounts: tuple[BindMount, ...]
    links: tuple[tuple[PurePosixPath, str], ...]
    """(link path in the container, its target): made only where nothing is."""
    ldcache_dirs: tuple[str, ...]
    skipped: tuple[str, ...]


def provides_library(edits: ContainerEdits, name: str = LIBCUDA) -> bool:
    """Whether applying ``edits`` puts ``name`` (a SONAME) in the container."""
    stem = name.split(".so", 1)[0] + ".so"
    return any(m.container_path.name.startswith(stem) for m in edits.mounts)


def container_has_library(pid: int, name: str = LIBCUDA, *, proc: Path = procfs.PROC) -> bool:
    """Whether the container's loader can find ``name``: a file (or a link to one) of that
    name in a standard library directory. Reads only; the container's own links are followed
    inside its root (never out of it)."""
    try:
        root = os.open(proc / str(pid) / "root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        for path in (*(f"{d}/{name}" for d in _LIBRARY_DIRS), *_CACHE_FILES):
            try:
                fd = openat2(root, path, os.O_RDONLY, resolve=RESOLVE_IN_ROOT)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as f:
                # A library file; or the loader's cache naming it (a driver in a directory of
                # the container's ld.so.conf) — bounded read, a cache is some 100 KiB.
                if path not in _CACHE_FILES or name.encode() + b"\0" in f.read(_CACHE_LIMIT):
                    return True
        return False
    finally:
        os.close(root)


def apply(
    pid: int,
    edits: ContainerEdits,
    *,
    record: Path,
    start_time: int | None = None,
    source_root: Path = bindmounts.ROOT,
    proc: Path = procfs.PROC,
) -> Applied:
    """Give the container of ``pid`` the spec's mounts, links and ldcache (idempotent: what
    is there is left; a second call adds nothing). All or nothing: on failure what this call
    made is undone and :class:`DriverEditsError` raised. ``start_time`` (read now when not
    given) is recorded with ``pid``: a later :func:`remove` acts on that very process only."""
    if start_time is None:
        who = procfs.identity(pid, proc=proc)
        if who is None:
            raise DriverEditsError(f"process {pid} is gone")
        start_time = who.start_time
    if _shares_root(pid, source_root, proc):
        # A process on the host (local mode's kernel), or in a container whose root is the
        # host's, sees the host's driver already: nothing of the host's is mounted over,
        # created or re-cached.
        return Applied((), (), False, (), ())
    plan = _plan(edits, source_root=source_root)
    previous = _read_record(record)
    # Only what is missing is ours: a mount or link already there (the runtime's) is never
    # recorded, so never taken back.
    planned_mounts = [
        m
        for m in plan.mounts
        if not bindmounts.is_bound(pid, m, source_root=source_root, proc=proc)
    ]
    planned_links = [(link, target) for link, target in plan.links if not _exists(pid, link, proc)]
    if not planned_mounts and not planned_links:
        # All there already (a reconciliation's check, a second GPU): nothing to record.
        return Applied((), (), False, tuple(edits.env), plan.skipped)
    if previous and (previous.get("pid"), previous.get("start_time")) != (pid, start_time):
        remove(record, proc=proc)  # a record of an earlier process under the same key
        previous = {}
    intent: dict[str, Any] = {
        "pid": pid,
        "start_time": start_time,
        "source_root": str(source_root),
        "mounts": _merge(previous.get("mounts", []), [_mount_json(m) for m in planned_mounts]),
        "links": _merge(previous.get("links", []), [[str(p), t] for p, t in planned_links]),
        "created": list(previous.get("created", [])),
        "ldcache": bool(previous.get("ldcache")),
    }
    intent["created"] = _merge(intent["created"], _missing_entries(pid, planned_mounts, proc))
    _write_record(record, intent)
    made_links: list[PurePosixPath] = []
    try:
        made = bindmounts.bind(pid, planned_mounts, source_root=source_root, proc=proc)
        for link, target in planned_links:
            if _make_link(pid, link, target, proc):
                made_links.append(link)
        ldcache = False
        if plan.ldcache_dirs and (planned_mounts or planned_links):
            # Recorded just before: a cache rebuilt by us is rebuilt again on removal.
            _write_record(record, {**intent, "ldcache": True})
            ldcache = _ldconfig(pid, plan.ldcache_dirs, proc)
    except (MountError, OSError) as e:
        failures = remove(record, proc=proc)
        raise DriverEditsError(
            f"giving the container the driver's files failed: {e}"
            + (f"; undo incomplete: {'; '.join(failures)}" if failures else "")
        ) from e
    return Applied(
        tuple(m.mount.target for m in made),
        tuple(made_links),
        ldcache,
        tuple(edits.env),
        plan.skipped,
    )


def remove(record: Path, *, proc: Path = procfs.PROC) -> list[str]:
    """Undo what :func:`apply` recorded in ``record``: unmount its mounts (while they still
    show the host's file), delete its links (while they still point where it made them) and
    mount points (while empty), rebuild the ldcache, then delete the record. Only the very
    process recorded (pid *and* start time) is touched: a pid reused by another container is
    not ours. Returns what could not be undone (empty: all of it is gone); a container that
    is gone has nothing left to undo."""
    data = _read_record(record)
    if not data:
        return []
    pid = int(data.get("pid", 0))
    who = procfs.identity(pid, proc=proc) if pid > 0 else None
    failures: list[str] = []
    alive = who is not None and who.start_time == data.get("start_time")
    if alive:
        source_root = Path(data.get("source_root", "/"))
        mounts = [_mount_from(m) for m in data.get("mounts", [])]
        try:
            bindmounts.unbind(pid, mounts, source_root=source_root, proc=proc)
        except (MountError, OSError) as e:
            failures.append(f"unmounting the driver's files: {e}")
        for link, target in reversed(data.get("links", [])):
            try:
                _remove_link(pid, PurePosixPath(link), target, proc)
            except OSError as e:
                failures.append(f"removing the link {link}: {e.strerror}")
        if not failures:
            bindmounts.remove_created(
                pid, [PurePosixPath(p) for p in data.get("created", [])], proc=proc
            )
            if data.get("ldcache"):
                try:
                    _ldconfig(pid, (), proc)
                except OSError as e:
                    failures.append(f"rebuilding the container's ldcache: {e}")
    if not failures:
        with suppress(FileNotFoundError):
            record.unlink()
    return failures


def _plan(edits: ContainerEdits, *, source_root: Path) -> _Plan:
    """What ``edits`` ask of a container, as mounts, links and ldcache folders; the hooks that
    are none of these are named in ``skipped``."""
    mounts = tuple(
        BindMount(m.host_path, m.container_path, tuple(m.options) or ("ro", "nosuid", "nodev"))
        for m in edits.mounts
    )
    links = _soname_links(mounts, source_root)
    ldcache: list[str] = []
    skipped: list[str] = []
    for hook in edits.hooks:
        command = _hook_command(hook)
        if command is None:
            skipped.append(f"{hook.path} {' '.join(hook.args[1:])}".strip())
        elif command[0] == _LINK_HOOK:
            links += _link_args(command[1:])
        elif command[0] == _LDCACHE_HOOK:
            ldcache += _folder_args(command[1:]) or [str(m.target.parent) for m in mounts]
        else:
            skipped.append(command[0])
    if not ldcache:
        # A spec without an update-ldcache hook: the libraries it mounts need a cache entry all
        # the same (a loader reads its cache before its default directories).
        ldcache += [str(m.target.parent) for m in mounts if ".so" in m.target.name]
    return _Plan(mounts, tuple(dict.fromkeys(links)), tuple(dict.fromkeys(ldcache)), tuple(skipped))


def _shares_root(pid: int, source_root: Path, proc: Path) -> bool:
    """Whether ``pid`` is in the agent's own mount namespace or has the host's root (as the
    agent sees it, ``source_root``) for its root directory."""
    try:
        return (proc / str(pid) / "ns" / "mnt").stat()[1:3] == (
            proc / "self" / "ns" / "mnt"
        ).stat()[1:3] or (proc / str(pid) / "root").stat()[1:3] == source_root.stat()[1:3]
    except FileNotFoundError as e:
        raise DriverEditsError(f"process {pid} is gone") from e


def _hook_command(hook: Hook) -> list[str] | None:
    """The toolkit hook's subcommand and its arguments, or None for a hook of another program."""
    if hook.path.name not in _HOOK_PROGRAMS:
        return None
    args = list(hook.args[1:])
    if args[:1] == ["hook"]:  # nvidia-ctk hook <subcommand>
        args = args[1:]
    if not args or (args[0] not in (_LINK_HOOK, _LDCACHE_HOOK) and args[0] not in _SKIPPED_HOOKS):
        return None
    return args


def _link_args(args: Sequence[str]) -> list[tuple[PurePosixPath, str]]:
    """``--link target::link`` pairs (the toolkit's create-symlinks syntax)."""
    links = []
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--link" and i + 1 < len(args) else None
        if arg.startswith("--link="):
            value = arg.removeprefix("--link=")
        if value and "::" in value:
            target, link = value.split("::", 1)
            if link.startswith("/") and ".." not in PurePosixPath(link).parts and target:
                links.append((PurePosixPath(link), target))
    return links


def _folder_args(args: Sequence[str]) -> list[str]:
    folders = []
    for i, arg in enumerate(args):
        if arg == "--folder" and i + 1 < len(args):
            folders.append(args[i + 1])
        elif arg.startswith("--folder="):
            folders.append(arg.removeprefix("--folder="))
    return [f for f in folders if f.startswith("/") and ".." not in PurePosixPath(f).parts]


def _soname_links(
    mounts: Sequence[BindMount], source_root: Path
) -> list[tuple[PurePosixPath, str]]:
    """The links beside each mount's source in the host's driver root that name it
    (``libcuda.so.1 -> libcuda.so.550.54.15``): the same links belong beside its target. Each
    directory is read once per plan (a host driver's directory has thousands of entries, and a
    reconciliation plans every GPU-holding container)."""
    by_directory: dict[PurePosixPath, list[BindMount]] = {}
    for mount in mounts:
        by_directory.setdefault(mount.source.parent, []).append(mount)
    links = []
    for parent, beside in by_directory.items():
        by_name = {mount.source.name: mount for mount in beside}
        with suppress(OSError):
            for entry in os.scandir(source_root / str(parent).lstrip("/")):
                if not entry.is_symlink():
                    continue
                named = by_name.get(os.readlink(entry.path))
                if named is not None:
                    links.append((named.target.parent / entry.name, named.target.name))
    return sorted(links)


def _exists(pid: int, path: PurePosixPath, proc: Path) -> bool:
    """Whether anything is at ``path`` in the container (a link on the way counts: something
    the container made is there, and it is not ours)."""
    try:
        parent = _parent_fd(pid, path, proc)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        os.stat(path.name, dir_fd=parent, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(parent)


def _parent_fd(pid: int, path: PurePosixPath, proc: Path) -> int:
    with ExitStack() as stack:
        root = os.open(proc / str(pid) / "root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        stack.callback(os.close, root)
        return openat2(root, str(path.parent), os.O_PATH | os.O_DIRECTORY, resolve=DIRECTORIES)


def _make_link(pid: int, link: PurePosixPath, target: str, proc: Path) -> bool:
    """Make ``link -> target`` in the container unless something is there already."""
    try:
        parent = _parent_fd(pid, link, proc)
    except FileNotFoundError:
        return False  # no such directory in this image: the link has nowhere to be
    try:
        os.symlink(target, link.name, dir_fd=parent)
        return True
    except FileExistsError:
        return False
    finally:
        os.close(parent)


def _remove_link(pid: int, link: PurePosixPath, target: str, proc: Path) -> None:
    try:
        parent = _parent_fd(pid, link, proc)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        if e.errno == errno.ELOOP:
            return  # the container replaced a directory with a link: nothing of ours is behind
        raise
    try:
        if os.readlink(link.name, dir_fd=parent) == target:
            os.unlink(link.name, dir_fd=parent)
    except (FileNotFoundError, OSError) as e:
        if e.errno not in (errno.ENOENT, errno.EINVAL):  # EINVAL: not a link (not ours)
            raise
    finally:
        os.close(parent)


def _ldconfig(pid: int, folders: Iterable[str], proc: Path) -> bool:
    """Rebuild the container's ldcache (only where it has one: a musl image has none)."""
    if not any(_exists(pid, PurePosixPath(f), proc) for f in _CACHE_FILES):
        return False
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    result = subprocess.run(
        [ldconfig, "-X", "-r", str(proc / str(pid) / "root"), *folders],
        capture_output=True,
        text=True,
        timeout=LDCONFIG_TIMEOUT,
        check=False,
    )
    if result.returncode != 0:
        raise OSError(errno.EIO, f"ldconfig exited {result.returncode}: {result.stderr[-500:]}")
    return True


def _missing_entries(pid: int, mounts: Sequence[BindMount], proc: Path) -> list[str]:
    """The mount points (and their parents) that do not exist yet: what :func:`bind` will
    create, recorded before it does."""
    missing: list[str] = []
    for mount in mounts:
        chain = [*reversed(mount.target.parents[:-1]), mount.target]
        for path in chain:
            if not _exists(pid, path, proc):
                missing += [str(p) for p in chain[chain.index(path) :]]
                break
    return list(dict.fromkeys(missing))


def _mount_json(mount: BindMount) -> list[object]:
    return [str(mount.source), str(mount.target), list(mount.options)]


def _mount_from(data: Sequence[Any]) -> BindMount:
    source, target, options = data
    return BindMount(PurePosixPath(str(source)), PurePosixPath(str(target)), tuple(options))


def _merge(old: Sequence[Any], new: Sequence[Any]) -> list[Any]:
    """``old`` and what of ``new`` it lacks, in order (a record only grows until removed)."""
    return [*old, *(x for x in new if x not in old)]


def _read_record(record: Path) -> dict[str, Any]:
    try:
        data = json.loads(record.read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        log.error("the driver-edits record %s is unreadable; it is replaced", record)
        return {}
    return data if isinstance(data, dict) else {}


def _write_record(record: Path, data: dict[str, Any]) -> None:
    record.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    scratch = record.with_suffix(".tmp")
    with scratch.open("w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    scratch.replace(record)
