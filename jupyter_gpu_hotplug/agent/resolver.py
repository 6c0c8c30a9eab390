"""Local mode's resolver: from a pid to a target the agent may act on, and to its container.

Why it exists: a request names a process by pid, which is ambiguous over time and may name
something that must never get a GPU. This module binds a pid to one process lifetime (pid and
start time, from ``/proc/<pid>/stat``), tells which *container* it belongs to (its device
cgroups, read from ``/proc/<pid>/cgroup``, never constructed), and refuses targets that are not
containers: the host's init, the agent itself, anything in a root cgroup (a grant there would
reach the whole host) or in the agent's own cgroup (the agent, its children, and whatever else
runs beside it).

A container's identity is the pair of cgroups that govern device access (v1 ``devices`` and the
unified hierarchy) with crun's inner ``container`` leaf folded into its scope, as the engine
does. Authorization compares these: a caller on the unix socket may act on targets in its own
container.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .._structs import PidRef, PidTarget
from ..linux import cgroups, procfs
from ..linux.engine import CRUN_INNER_CGROUP
from .errors import Forbidden, NotFound

__all__ = ["ContainerId", "ProcResolver", "ResolvedTarget", "Resolver"]

_NOT_A_CONTAINER_HINT = (
    "give the pid of a process inside a container or sandbox (for example a kernel started by "
    "`jupyter gpu-hotplug demo`)"
)


@dataclass(frozen=True)
class ContainerId:
    """The device cgroups of a container, as ``/proc/<pid>/cgroup`` names them."""

    devices_v1: str | None
    unified: str | None

    @property
    def in_root_cgroup(self) -> bool:
        """In the root of a hierarchy: no container confines it."""
        return "/" in (self.devices_v1, self.unified)

    def __str__(self) -> str:
        parts = [
            f"{name}:{path}"
            for name, path in (("devices", self.devices_v1), ("unified", self.unified))
            if path is not None
        ]
        return ", ".join(parts) or "no device cgroup"


@dataclass(frozen=True)
class ResolvedTarget:
    """A live process the agent may act on, and the container it belongs to."""

    target: PidTarget
    container: ContainerId


class Resolver(Protocol):
    """Targets and callers of local mode. Calls read ``/proc`` and may block briefly."""

    def resolve(self, ref: PidRef) -> ResolvedTarget:
        """Bind ``ref`` to the process that has the pid now; ``NotFound`` when there is none,
        ``Forbidden`` when it is not a container the agent may touch."""

    def lookup(self, target: PidTarget) -> ResolvedTarget | None:
        """``target`` if that very process still runs (pid and start time), else None."""

    def container_of(self, pid: int) -> ContainerId | None:
        """The container of any process (a caller), or None when it is gone."""

    def representative(self, pid: int) -> ResolvedTarget:
        """ "The caller itself": the oldest process of ``pid``'s container, which outlives
        short-lived callers such as a terminal command. Same errors as ``resolve``."""


def _fold_inner(path: str | None) -> str | None:
    """crun runs the workload in ``<scope>/container``; the scope is the container."""
    if path is None:
        return None
    head, _, leaf = path.rpartition("/")
    return (head or "/") if leaf == CRUN_INNER_CGROUP else path


class ProcResolver:
    """``Resolver`` over a procfs and the host's cgroup mounts.

    ``host_proc`` is the procfs pids are given in; ``hierarchies`` says which device
    hierarchies exist (a path in one that is not mounted does not count); ``agent_pid`` is this
    agent as ``host_proc`` numbers it.
    """

    def __init__(
        self,
        *,
        host_proc: Path,
        hierarchies: cgroups.CgroupHierarchies,
        agent_pid: int | None = None,
    ) -> None:
        self._proc = host_proc
        self._hierarchies = hierarchies
        self._agent_pid = os.getpid() if agent_pid is None else agent_pid
        agent_container = self.container_of(self._agent_pid)
        if agent_container is None:
            raise ValueError(f"the agent's own pid {self._agent_pid} is not in {host_proc}")
        self._agent_container = agent_container

    @property
    def agent_container(self) -> ContainerId:
        return self._agent_container

    def container_of(self, pid: int) -> ContainerId | None:
        try:
            text = (self._proc / str(pid) / "cgroup").read_text()
        except OSError as e:
            if procfs.is_gone(e):
                return None
            raise
        paths = cgroups.parse_proc_cgroup(text)
        return ContainerId(
            devices_v1=_fold_inner(paths.devices_v1)
            if self._hierarchies.devices_v1 is not None
            else None,
            unified=_fold_inner(paths.unified) if self._hierarchies.unified is not None else None,
        )

    def lookup(self, target: PidTarget) -> ResolvedTarget | None:
        who = procfs.identity(target.pid, proc=self._proc)
        if who is None or who.start_time != target.start_time:
            return None
        container = self.container_of(target.pid)
        if container is None or procfs.identity(target.pid, proc=self._proc) != who:
            return None
        return ResolvedTarget(target, container)

    def resolve(self, ref: PidRef) -> ResolvedTarget:
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
        resolved = ResolvedTarget(ref.resolve(start_time=who.start_time), container)
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
        return resolved

    def representative(self, pid: int) -> ResolvedTarget:
        container = self.container_of(pid)
        if container is None:
            raise NotFound("process", str(pid), hint="the calling process exited")
        if container.in_root_cgroup or container == self._agent_container:
            # resolve() gives the precise reason.
            return self.resolve(PidRef(pid))
        oldest: tuple[int, int] | None = None
        for member in self._members(container):
            who = procfs.identity(member, proc=self._proc)
            if who is None or self.container_of(member) != container:
                continue
            if oldest is None or (who.start_time, member) < oldest:
                oldest = (who.start_time, member)
        return self.resolve(PidRef(pid if oldest is None else oldest[1]))

    def _members(self, container: ContainerId) -> list[int]:
        """Every process in the container's cgroup and below (from whichever hierarchy)."""
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
