"""Local mode's ``Resolver``: from a pid to the container the agent acts on.

Why it exists: a request names a process by pid, which is ambiguous over time and may name
something that must never get a GPU. This module binds a pid to one process lifetime (pid and
start time, from ``/proc/<pid>/stat``), tells which *container* it belongs to (its device
cgroups, read from ``/proc/<pid>/cgroup``, never constructed), and refuses targets that are not
containers: the host's init, the agent itself, anything in a root cgroup (a grant there would
reach the whole host), in the agent's own cgroup (the agent, its children, and whatever else
runs beside it), or whose ``/dev`` is the host's ``/dev`` — the agent's own mount namespace,
but also a mount namespace of its own with the host's ``/dev`` still mounted (``unshare -Urm``)
or a chroot's ``/dev`` on a host filesystem: the agent must never create (or remove) a node
there, so only a private tmpfs ``/dev`` (what container runtimes mount) is accepted.

A container is the pair of cgroups that govern device access (v1 ``devices`` and the unified
hierarchy) with crun's inner ``container`` leaf folded into its scope, as the engine does. Its
``ContainerKey`` adds the cgroup ids (directory inodes, never reused for a new cgroup), so a
container that is removed and re-created under the same path is another container. The owner
of a grant is the container: when the target process exits while other processes of its
container live on, ``current`` finds the container through its oldest remaining process, and
``remains`` finds the empty cgroups of a container that has no process left. A container is
its cgroup subtree: a process that moved into a child cgroup of its own is still in it (the
grant reaches it there), so the container has not exited while any process lives below it.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace
from pathlib import Path

from ..._structs import PidRef, PidTarget, PodTarget, Target, TargetRef
from ...linux import cgroups, devnodes, procfs
from ...linux.engine import CRUN_INNER_CGROUP
from ..core.errors import AgentError, Forbidden, NotFound
from ..core.seams import ContainerCgroups, ContainerKey, HostContainer

__all__ = ["ProcResolver"]

_NOT_A_CONTAINER_HINT = (
    "give the pid of a process inside a container or sandbox (for example a kernel started by "
    "`jupyter gpu-hotplug demo`)"
)
LOCAL_TARGET_HINT = 'in local mode a target is a process: {"pid": N}'
_KEY_PREFIX = "local:"


def _fold_inner(path: str | None) -> str | None:
    """crun runs the workload in ``<scope>/container``; the scope is the container."""
    if path is None:
        return None
    head, _, leaf = path.rpartition("/")
    return (head or "/") if leaf == CRUN_INNER_CGROUP else path


def _pids(proc: Path) -> Iterator[int]:
    """Every pid ``proc`` lists now."""
    with os.scandir(proc) as entries:
        for entry in entries:
            if entry.name.isdigit():
                yield int(entry.name)


def _below_scope(container: ContainerCgroups, scope: str) -> bool:
    """Whether every cgroup of ``container`` lies at or below the path ``scope``."""
    top = scope.rstrip("/") + "/"
    return all(
        path == scope or f"{path.rstrip('/')}/".startswith(top)
        for path in (container.devices_v1, container.unified)
        if path is not None
    )


def decode_key(key: ContainerKey) -> ContainerCgroups | None:
    """The cgroups a local ``ContainerKey`` names; None for another backend's or an empty key."""
    if not key.startswith(_KEY_PREFIX):
        return None
    v1, _, unified, _ = json.loads(key.removeprefix(_KEY_PREFIX))
    return ContainerCgroups(devices_v1=v1, unified=unified)


class ProcResolver:
    """``Resolver`` over a procfs and the host's cgroup mounts.

    ``host_proc`` is the procfs pids are given in; ``hierarchies`` says which device
    hierarchies exist (a path in one that is not mounted does not count); ``agent_pid`` is this
    agent as ``host_proc`` numbers it; ``check_dev`` raises ``devnodes.DevNodeError`` unless a
    pid's ``/dev`` is a private one (default: ``devnodes.check_private_dev`` in ``host_proc``).
    """

    def __init__(
        self,
        *,
        host_proc: Path,
        hierarchies: cgroups.CgroupHierarchies,
        agent_pid: int | None = None,
        check_dev: Callable[[int], None] | None = None,
    ) -> None:
        self._proc = host_proc
        self._check_dev = check_dev or functools.partial(devnodes.check_private_dev, proc=host_proc)
        self._hierarchies = hierarchies
        self._agent_pid = os.getpid() if agent_pid is None else agent_pid
        agent_container = self.container_of(self._agent_pid)
        if agent_container is None:
            raise ValueError(f"the agent's own pid {self._agent_pid} is not in {host_proc}")
        self._agent_container = agent_container
        agent_mounts = self._mount_namespace(self._agent_pid)
        if agent_mounts is None:
            raise ValueError(
                f"cannot read the mount namespace of the agent's pid {self._agent_pid}"
            )
        self._agent_mounts = agent_mounts

    @property
    def agent_container(self) -> ContainerCgroups:
        return self._agent_container

    # --- containers ------------------------------------------------------------------------------

    def container_of(self, pid: int) -> ContainerCgroups | None:
        """The container of any process (a caller, a target), or None when it is gone."""
        try:
            text = (self._proc / str(pid) / "cgroup").read_text()
        except OSError as e:
            if procfs.is_gone(e):
                return None
            raise
        paths = cgroups.parse_proc_cgroup(text)
        return ContainerCgroups(
            devices_v1=_fold_inner(paths.devices_v1)
            if self._hierarchies.devices_v1 is not None
            else None,
            unified=_fold_inner(paths.unified) if self._hierarchies.unified is not None else None,
        )

    def _mount_namespace(self, pid: int) -> tuple[int, int] | None:
        """The identity (device, inode) of ``pid``'s mount namespace; None when it is gone."""
        try:
            info = os.stat(self._proc / str(pid) / "ns" / "mnt")
        except OSError as e:
            if procfs.is_gone(e):
                return None
            raise
        return info.st_dev, info.st_ino

    def key_of(self, container: ContainerCgroups) -> ContainerKey:
        """The container's key: its cgroups and their cgroup ids (0 where unreadable)."""
        v1 = self._cgroup_id(self._hierarchies.devices_v1, container.devices_v1)
        unified = self._cgroup_id(self._hierarchies.unified, container.unified)
        fields = [container.devices_v1, v1, container.unified, unified]
        return ContainerKey(_KEY_PREFIX + json.dumps(fields, separators=(",", ":")))

    def _cgroup_id(self, mount: cgroups.CgroupMount | None, path: str | None) -> int:
        if mount is None or path is None:
            return 0
        try:
            return os.stat(mount.directory_of(path)).st_ino
        except (OSError, cgroups.CgroupError):
            return 0

    def members(self, container: ContainerCgroups) -> list[int]:
        """Every process in the container's cgroups and below (from whichever hierarchy)."""
        for mount, path in (
            (self._hierarchies.unified, container.unified),
            (self._hierarchies.devices_v1, container.devices_v1),
        ):
            if mount is None or path is None:
                continue
            try:
                return cgroups.pids_in_cgroup(mount.directory_of(path), recursive=True)
            except cgroups.CgroupError:
                continue
        return []

    def oldest_member(self, container: ContainerCgroups, *, subtree: bool = False) -> int | None:
        """The container's oldest process, which outlives short-lived ones such as a terminal
        command (what "the caller itself" means); None when it has none. ``subtree``: any
        process below the container's cgroups counts too (one may have moved into a child
        cgroup of its own, and a grant reaches it there)."""
        oldest: tuple[int, int] | None = None
        for member in self.members(container):
            who = procfs.identity(member, proc=self._proc)
            where = self.container_of(member)
            if who is None or where is None:
                continue
            if not (where.within(container) if subtree else where == container):
                continue
            if oldest is None or (who.start_time, member) < oldest:
                oldest = (who.start_time, member)
        return None if oldest is None else oldest[1]

    # --- the node sweep --------------------------------------------------------------------------

    def running(
        self, *, within: str = "/", owners: Collection[ContainerKey] = ()
    ) -> list[HostContainer]:
        """Every container of the host below the cgroup ``within`` (in each hierarchy in use)
        that ``resolve`` would accept as a target, each once, through its oldest process: what
        the node sweep judges (blocking: a walk over ``/proc``). A container that lies in the
        cgroups of one that holds reservations (``owners``: a process that moved into a child
        cgroup of its own) is that container, as ``lookup`` has it: the grant it can open is
        its owner's, never an orphan."""
        folded = [owner for owner in map(decode_key, owners) if owner is not None]
        oldest: dict[ContainerCgroups, tuple[int, int]] = {}
        for pid in _pids(self._proc):
            try:
                where = self.container_of(pid)
                if where is None or where.in_root_cgroup or where == self._agent_container:
                    continue  # gone, a host process (kernel threads too), the agent's own
                who = procfs.identity(pid, proc=self._proc)
            except OSError:
                continue  # one process's unreadable /proc entry hides no other container
            if who is None or not _below_scope(where, within):
                continue
            where = next((owner for owner in folded if where.within(owner)), where)
            if (who.start_time, pid) < oldest.get(where, (who.start_time + 1, 0)):
                oldest[where] = (who.start_time, pid)
        found = []
        for where, (_, pid) in oldest.items():
            try:
                container = self.resolve(PidRef(pid))
            except (AgentError, OSError):
                continue  # exited meanwhile, or not a container (the host's /dev)
            if container.cgroups != where:
                container = replace(container, cgroups=where, key=self.key_of(where))
            found.append(container)
        return found

    # --- the Resolver seam -----------------------------------------------------------------------

    def resolve(self, ref: TargetRef) -> HostContainer:
        if isinstance(ref, PodTarget):
            # Well formed, but no pod exists for the local backend: not found (404), as the
            # document promises for every target it calls valid.
            raise NotFound(
                "pod",
                f"{ref.namespace}/{ref.name}",
                hint=f"this agent runs the local backend; {LOCAL_TARGET_HINT}",
            )
        pid = ref.pid
        if pid == self._agent_pid:
            raise Forbidden(
                f"process {pid} is the GPU hot-plug agent itself", hint=_NOT_A_CONTAINER_HINT
            )
        who = procfs.identity(pid, proc=self._proc)
        if who is None:
            raise NotFound("process", str(pid), hint="check the pid; the process may have exited")
        container = self.container_of(pid)
        # Read again: the cgroups read must belong to the process whose start time we hold.
        if container is None or procfs.identity(pid, proc=self._proc) != who:
            raise NotFound("process", str(pid), hint="the process exited while being looked up")
        if container.in_root_cgroup:
            raise Forbidden(
                f"process {pid} ({who.comm}) is not in a container: it runs in a root cgroup, "
                "where a GPU grant would reach the whole host",
                hint=_NOT_A_CONTAINER_HINT,
            )
        if container == self._agent_container:
            raise Forbidden(
                f"process {pid} ({who.comm}) runs in the agent's own cgroup ({container}), "
                "not in a container",
                hint=_NOT_A_CONTAINER_HINT,
            )
        mounts = self._mount_namespace(pid)
        if mounts is None:
            raise NotFound("process", str(pid), hint="the process exited while being looked up")
        if mounts == self._agent_mounts:
            raise Forbidden(
                f"process {pid} ({who.comm}) shares the agent's mount namespace, so its /dev "
                "is the host's: the agent never creates GPU nodes there",
                hint="run the process in a container or sandbox with its own /dev",
            )
        try:
            self._check_dev(pid)
        except devnodes.ContainerGoneError as e:
            raise NotFound(
                "process", str(pid), hint="the process exited while being looked up"
            ) from e
        except devnodes.DevNodeError as e:
            raise Forbidden(
                f"process {pid} ({who.comm}) is not in a container with a /dev of its own: {e}; "
                "the agent never creates GPU nodes in the host's /dev",
                hint="run the process in a container or sandbox with its own /dev",
            ) from e
        return self._host_container(pid, who, container)

    def _host_container(
        self, pid: int, who: procfs.ProcessIdentity, container: ContainerCgroups
    ) -> HostContainer:
        return HostContainer(
            target=PidRef(pid).resolve(start_time=who.start_time),
            key=self.key_of(container),
            pid=pid,
            start_time=who.start_time,
            cgroups=container,
            label=f"process {pid} ({who.comm})",
        )

    def lookup(self, target: Target, key: ContainerKey) -> HostContainer | None:
        if not isinstance(target, PidTarget):
            return None
        who = procfs.identity(target.pid, proc=self._proc)
        if who is None or who.start_time != target.start_time:
            return None
        container = self.container_of(target.pid)
        if container is None or procfs.identity(target.pid, proc=self._proc) != who:
            return None
        found = self._host_container(target.pid, who, container)
        # An empty key: a reservation of an agent that did not record containers.
        if not key or found.key == key:
            return found
        # Still in the same container, in a cgroup below its own (made by the container).
        owner = decode_key(key)
        if owner is not None and container.within(owner) and self.key_of(owner) == key:
            return self._host_container(target.pid, who, owner)
        return None

    def current(self, target: Target, key: ContainerKey) -> HostContainer | None:
        found = self.lookup(target, key)
        if found is not None:
            return found
        container = decode_key(key)
        if container is None:
            return None
        pid = self.oldest_member(container, subtree=True)
        if pid is None:
            return None
        who = procfs.identity(pid, proc=self._proc)
        if who is None:
            return None
        candidate = self._host_container(pid, who, container)
        return candidate if candidate.key == key else None

    def remains(self, key: ContainerKey) -> ContainerCgroups | None:
        container = decode_key(key)
        if container is None or self.key_of(container) != key:
            return None
        return container
