"""Device nodes in a running container's ``/dev``, made from outside it — safely.

Why this module exists: a hot-attached GPU also needs ``/dev/nvidia<minor>`` in
the container's mount namespace, and the container is hostile ground. Running
its own ``mknod`` fails in images without one; ``setns(CLONE_NEWNS)`` fails in a
multi-threaded agent; and the obvious ``/proc/<pid>/root/dev/nvidia3`` path is a
host escape, because an absolute symlink the container plants there is resolved
against the *agent's* root. So every path here is resolved by the kernel with
``openat2`` relative to ``/proc/<pid>/root`` under ``RESOLVE_IN_ROOT`` (nothing
can leave the container's root) and ``RESOLVE_NO_SYMLINKS`` (no link is followed
at all — a container has no business linking its ``/dev`` or our node names);
nodes are made with ``mknodat``, checked and chmod-ed through an ``O_PATH`` fd of
the very inode, and removed with ``unlinkat`` only when they are the device we
expect. Names are restricted to the NVIDIA ones, so nothing else in ``/dev`` can
be touched through this module.

It also answers which NVIDIA control nodes the host has (``nvidiactl`` and the
dynamically numbered ``nvidia-uvm`` pair), which every CUDA process needs.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ._sys import (
    RESOLVE_BENEATH,
    RESOLVE_IN_ROOT,
    RESOLVE_NO_SYMLINKS,
    TMPFS_MAGIC,
    fd_path,
    fs_type,
    openat2,
)
from .devrules import NVIDIACTL_MINOR, CharDevice

DEFAULT_MODE: Final = 0o666
"""The mode NVIDIA's own tools give their nodes (access is the cgroup's decision)."""
CAPS_DIR: Final = "nvidia-caps"
_CAPS_DIR_MODE: Final = 0o755
_PROC: Final = Path("/proc")
_HOST_DEV: Final = Path("/dev")
_HOST_INIT: Final = 1

_NODE_NAME: Final = re.compile(
    r"^(?:nvidia(?:0|[1-9][0-9]{0,2})|nvidiactl|nvidia-uvm|nvidia-uvm-tools"
    rf"|{CAPS_DIR}/nvidia-cap(?:0|[1-9][0-9]{{0,4}}))$"
)
_IN_CONTAINER: Final = RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS
_BELOW_DEV: Final = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS

# (node name, names the driver registers in /proc/devices, minor) — the nodes every
# CUDA process opens besides its GPUs; nvidia-uvm-tools is the uvm major's minor 1.
_CONTROL_NODES: Final = (
    ("nvidiactl", ("nvidia-frontend", "nvidia"), NVIDIACTL_MINOR),
    ("nvidia-uvm", ("nvidia-uvm",), 0),
    ("nvidia-uvm-tools", ("nvidia-uvm",), 1),
)


class DevNodeError(Exception):
    """Base of this module's errors: a node could not be made, checked or removed."""


class InvalidNodeNameError(DevNodeError, ValueError):
    """The name is not one of the NVIDIA node names this module may touch."""


class ContainerGoneError(DevNodeError):
    """The target process exited (or never existed); there is no /dev to change."""


class UnsafeNodeError(DevNodeError):
    """Something other than the expected device sits where a node should be: a
    symlink, a file, a directory or another device. It is never followed or removed."""


class HostDevError(UnsafeNodeError):
    """The process's ``/dev`` is the host's (or not a container's private tmpfs): the
    agent never creates, changes or removes a node there."""


@dataclass(frozen=True)
class DeviceNode:
    """A character device node, named relative to ``/dev``."""

    name: str
    device: CharDevice
    mode: int = DEFAULT_MODE


def validate_name(name: str) -> str:
    """``name`` if it is an NVIDIA node name (``nvidia<N>``, ``nvidiactl``, ``nvidia-uvm``,
    ``nvidia-uvm-tools``, ``nvidia-caps/nvidia-cap<N>``), else :class:`InvalidNodeNameError`."""
    if not _NODE_NAME.fullmatch(name):
        raise InvalidNodeNameError(f"{name!r} is not an NVIDIA device node name")
    return name


def ensure_node(
    pid: int,
    name: str,
    device: CharDevice,
    *,
    mode: int = DEFAULT_MODE,
    proc: Path = _PROC,
) -> bool:
    """Make ``/dev/<name>`` the char device ``device`` with ``mode``, owned by root, in
    the mount namespace of ``pid``. True when this call created it; False when it was
    already that device — made by someone else (the runtime, the host), so its mode and
    owner are never changed.

    Anything else at that name raises :class:`UnsafeNodeError` and is left alone; a
    ``/dev`` that is the host's raises :class:`HostDevError` (:func:`check_private_dev`).
    A node this call created is removed again if a later step fails. ``pid`` is in our
    pid namespace and ``proc`` is that namespace's procfs.
    """
    validate_name(name)
    if not 0 <= mode <= 0o777:
        raise ValueError(f"mode {mode:#o} is not a permission mode (0o0 to 0o777)")
    subdir, leaf = _split(name)
    with (
        _reported(f"making /dev/{name} ({device}) for process {pid}"),
        _container_dev(pid, proc) as devfd,
    ):
        _check_private(devfd, pid, proc)
        with _node_dir(devfd, subdir, create=True) as dirfd:
            return _ensure(dirfd, leaf, device, mode=mode, name=name)


def _ensure(dirfd: int, leaf: str, device: CharDevice, *, mode: int, name: str) -> bool:
    created = _mknod(dirfd, leaf, device, name=name)
    try:
        try:
            node = _open_node(dirfd, leaf, name=name)
        except FileNotFoundError as e:
            raise UnsafeNodeError(f"/dev/{name} vanished right after mknod") from e
        try:
            _check(os.fstat(node), device, name=name)
            if created:  # mknod's mode went through the umask; someone else's node stays
                os.chmod(fd_path(node), mode)
                os.chown(fd_path(node), 0, 0)
        finally:
            os.close(node)
    except BaseException as failure:
        if created:
            _undo_create(dirfd, leaf, device, failure)
        raise
    return created


def remove_node(pid: int, name: str, *, expect: CharDevice, proc: Path = _PROC) -> bool:
    """Remove ``/dev/<name>`` from the mount namespace of ``pid`` if it is the char
    device ``expect``. True when removed, False when nothing was there.

    Anything else at that name raises :class:`UnsafeNodeError`. The container could
    swap the entry between our check and the unlink; that only ever removes an
    entry of its own ``/dev``, never a host file, because the unlink is relative to
    the directory fd and does not follow the final name.
    """
    validate_name(name)
    subdir, leaf = _split(name)
    with _reported(f"removing /dev/{name} of process {pid}"), _container_dev(pid, proc) as devfd:
        _check_private(devfd, pid, proc)
        try:
            with _node_dir(devfd, subdir, create=False) as dirfd:
                node = _open_node(dirfd, leaf, name=name)
                try:
                    _check(os.fstat(node), expect, name=name)
                finally:
                    os.close(node)
                os.unlink(leaf, dir_fd=dirfd)
        except FileNotFoundError:
            return False
    return True


def list_nodes(pid: int, prefix: str = "nvidia", *, proc: Path = _PROC) -> list[DeviceNode]:
    """The char device nodes in the ``/dev`` of ``pid`` whose name starts with ``prefix``
    (``nvidia-caps/…`` entries included), sorted by name; links are not followed."""
    with (
        _reported(f"listing /dev of process {pid}"),
        _container_dev(pid, proc, readable=True) as devfd,
    ):
        nodes = _char_nodes(devfd, "")
        try:
            caps = openat2(devfd, CAPS_DIR, os.O_RDONLY | os.O_DIRECTORY, resolve=_BELOW_DEV)
        except OSError as e:
            # No real nvidia-caps directory (absent, a link, a file): it holds no nodes.
            if e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise DevNodeError(f"listing /dev/{CAPS_DIR} of process {pid}: {e}") from e
        else:
            try:
                nodes += _char_nodes(caps, f"{CAPS_DIR}/")
            finally:
                os.close(caps)
    return sorted((node for node in nodes if node.name.startswith(prefix)), key=lambda n: n.name)


def check_private_dev(pid: int, *, proc: Path = _PROC) -> None:
    """Raise :class:`HostDevError` unless the ``/dev`` of ``pid`` is a private one, where the
    agent may make nodes: a tmpfs (what every container runtime mounts there) that is not
    the host's ``/dev`` (the agent's own, or that of the host's init).

    Comparing mount namespaces is not enough: a process with a mount namespace of its own
    (``unshare -Urm``, no privilege needed) still has the host's ``/dev`` mounted, and a
    chroot's ``/dev`` may be a directory on a host filesystem where a node outlives it.
    """
    with _reported(f"checking the /dev of process {pid}"), _container_dev(pid, proc) as devfd:
        _check_private(devfd, pid, proc)


def _check_private(devfd: int, pid: int, proc: Path) -> None:
    where = f"the /dev of process {pid}"
    if fs_type(devfd) != TMPFS_MAGIC:
        raise HostDevError(f"{where} is not a private tmpfs (as a container's is)")
    device = os.fstat(devfd).st_dev
    if device == os.stat(_HOST_DEV).st_dev or device == _host_init_dev(proc):
        raise HostDevError(f"{where} is the host's /dev")


def _host_init_dev(proc: Path) -> int | None:
    """The filesystem of the host's ``/dev`` as its init sees it (the agent's own may be a
    pod's); None when it cannot be read."""
    try:
        with _container_dev(_HOST_INIT, proc) as devfd:
            return os.fstat(devfd).st_dev
    except (DevNodeError, OSError):
        return None


def parse_proc_devices(text: str) -> dict[str, int]:
    """Driver name → major, from the ``Character devices:`` section of ``/proc/devices``."""
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        header = line.strip()
        if header.endswith(":"):
            in_char = header == "Character devices:"
            continue
        fields = line.split(None, 1)
        if in_char and len(fields) == 2 and fields[0].isdigit():
            majors.setdefault(fields[1].strip(), int(fields[0]))
    return majors


def nvidia_control_devices(
    host_dev: Path = Path("/dev"), proc_devices: Path = Path("/proc/devices")
) -> list[DeviceNode]:
    """The NVIDIA control nodes this host has: ``nvidiactl``, ``nvidia-uvm``,
    ``nvidia-uvm-tools``. Empty on a machine without the driver.

    The host's node, when present, is the authority for the numbers. ``nvidia-uvm``
    has a dynamic major and its nodes are created lazily (by nvidia-modprobe on
    first CUDA use), so a driver registered in ``/proc/devices`` without a host node
    yet still counts, with the driver's major and the node's fixed minor.
    """
    try:
        majors = parse_proc_devices(proc_devices.read_text())
    except OSError as e:
        raise DevNodeError(f"cannot read {proc_devices}: {e.strerror}") from e
    found = []
    for name, drivers, minor in _CONTROL_NODES:
        device = _host_char_device(host_dev / name)
        if device is None:
            major = next((majors[driver] for driver in drivers if driver in majors), None)
            if major is None:
                continue
            device = CharDevice(major, minor)
        found.append(DeviceNode(name, device))
    return found


@contextmanager
def _reported(action: str) -> Iterator[None]:
    """Turn an unforeseen ``OSError`` (EROFS, EPERM, ...) into this module's error,
    saying what we were doing; errors already of this module pass unchanged."""
    try:
        yield
    except OSError as e:
        raise DevNodeError(f"{action} failed: {e}") from e


def _host_char_device(path: Path) -> CharDevice | None:
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISCHR(info.st_mode):
        raise UnsafeNodeError(f"host {path} exists but is not a character device")
    return CharDevice(os.major(info.st_rdev), os.minor(info.st_rdev))


def _split(name: str) -> tuple[str | None, str]:
    subdir, _, leaf = name.rpartition("/")
    return (subdir or None), leaf


@contextmanager
def _container_dev(pid: int, proc: Path, *, readable: bool = False) -> Iterator[int]:
    """A directory fd of ``/dev`` as the process ``pid`` sees it.

    The pidfd taken first and checked after ``/proc/<pid>/root`` is open makes
    sure the root belongs to that process and not to a successor with a reused pid.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError as e:
        raise ContainerGoneError(f"process {pid} does not exist") from e
    try:
        root_path = proc / str(pid) / "root"
        try:
            rootfd = os.open(root_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError) as e:
            raise ContainerGoneError(f"process {pid} exited ({root_path} is gone)") from e
        try:
            try:
                signal.pidfd_send_signal(pidfd, 0)
            except ProcessLookupError as e:
                raise ContainerGoneError(f"process {pid} exited while we opened its root") from e
            flags = (os.O_RDONLY if readable else os.O_PATH) | os.O_DIRECTORY
            try:
                devfd = openat2(rootfd, "dev", flags, resolve=_IN_CONTAINER)
            except OSError as e:
                raise _dev_error(pid, e) from e
            try:
                yield devfd
            finally:
                os.close(devfd)
        finally:
            os.close(rootfd)
    finally:
        os.close(pidfd)


def _dev_error(pid: int, error: OSError) -> DevNodeError:
    where = f"/dev of process {pid}"
    if error.errno == errno.ELOOP:
        return UnsafeNodeError(f"{where} is a symlink; refusing to follow it")
    if error.errno == errno.ENOTDIR:
        return UnsafeNodeError(f"{where} is not a directory")
    if error.errno == errno.ENOENT:
        return DevNodeError(f"process {pid} has no /dev")
    return DevNodeError(f"cannot open {where}: {error.strerror}")


@contextmanager
def _node_dir(devfd: int, subdir: str | None, *, create: bool) -> Iterator[int]:
    """The directory fd a node name's last part is relative to: ``/dev`` itself, or
    ``/dev/nvidia-caps`` (made, mode 0755, when ``create`` and missing)."""
    if subdir is None:
        yield devfd
        return
    try:
        dirfd = openat2(devfd, subdir, os.O_PATH | os.O_DIRECTORY, resolve=_BELOW_DEV)
    except FileNotFoundError:
        if not create:
            raise
        dirfd = _make_subdir(devfd, subdir)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeNodeError(f"/dev/{subdir} is not a plain directory; refusing") from e
        raise DevNodeError(f"cannot open /dev/{subdir}: {e.strerror}") from e
    try:
        yield dirfd
    finally:
        os.close(dirfd)


def _make_subdir(devfd: int, subdir: str) -> int:
    # Made concurrently (by the container, say): what it is gets checked by the open below.
    with suppress(FileExistsError):
        os.mkdir(subdir, _CAPS_DIR_MODE, dir_fd=devfd)
    try:
        dirfd = openat2(devfd, subdir, os.O_PATH | os.O_DIRECTORY, resolve=_BELOW_DEV)
    except OSError as e:
        raise UnsafeNodeError(f"/dev/{subdir} changed while we made it: {e.strerror}") from e
    os.chmod(fd_path(dirfd), _CAPS_DIR_MODE)  # mkdir's mode went through the umask
    return dirfd


def _mknod(dirfd: int, leaf: str, device: CharDevice, *, name: str) -> bool:
    """True when made, False when the name exists (what it is gets checked next).
    ``mknodat`` never follows a symlink at the final name: an existing one is EEXIST."""
    try:
        os.mknod(leaf, stat.S_IFCHR | 0o600, os.makedev(device.major, device.minor), dir_fd=dirfd)
    except FileExistsError:
        return False
    except OSError as e:
        raise DevNodeError(f"mknod /dev/{name} ({device}) failed: {e.strerror}") from e
    return True


def _open_node(dirfd: int, leaf: str, *, name: str) -> int:
    """An ``O_PATH`` fd of the entry itself (a symlink is opened, not followed)."""
    try:
        return openat2(dirfd, leaf, os.O_PATH | os.O_NOFOLLOW, resolve=_BELOW_DEV)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise
        raise DevNodeError(f"cannot open /dev/{name}: {e.strerror}") from e


def _check(info: os.stat_result, device: CharDevice, *, name: str) -> None:
    if stat.S_ISCHR(info.st_mode):
        found = CharDevice(os.major(info.st_rdev), os.minor(info.st_rdev))
        if found == device:
            return
        what = f"the device {found}"
    elif stat.S_ISLNK(info.st_mode):
        what = "a symlink"
    elif stat.S_ISDIR(info.st_mode):
        what = "a directory"
    else:
        what = f"a file of type {stat.S_IFMT(info.st_mode):#o}"
    raise UnsafeNodeError(f"/dev/{name} is {what}, not {device}; leaving it alone")


def _undo_create(dirfd: int, leaf: str, device: CharDevice, failure: BaseException) -> None:
    """Remove a node we just made after a later step failed; a failure to do so is
    added to the original error rather than hiding it."""
    try:
        node = openat2(dirfd, leaf, os.O_PATH | os.O_NOFOLLOW, resolve=_BELOW_DEV)
        try:
            info = os.fstat(node)
        finally:
            os.close(node)
        if stat.S_ISCHR(info.st_mode) and info.st_rdev == os.makedev(device.major, device.minor):
            os.unlink(leaf, dir_fd=dirfd)
    except OSError as e:
        failure.add_note(f"the node made before the failure could not be removed: {e}")


def _char_nodes(dirfd: int, prefix: str) -> list[DeviceNode]:
    nodes = []
    with os.scandir(dirfd) as entries:
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we listed
            if stat.S_ISCHR(info.st_mode):
                device = CharDevice(os.major(info.st_rdev), os.minor(info.st_rdev))
                nodes.append(DeviceNode(prefix + entry.name, device, stat.S_IMODE(info.st_mode)))
    return nodes
