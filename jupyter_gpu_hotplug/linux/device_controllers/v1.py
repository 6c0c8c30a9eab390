"""cgroup v1: a container's devices as entries of its ``devices`` cgroup's allow list.

A grant writes ``c M:m rw`` to ``devices.allow`` of the container's cgroup and every cgroup
below it (an allow is not inherited by existing children); a revoke writes ``devices.deny``
at the top only (a deny propagates down). :mod:`..cgroup_v1` does the writes and proves each
one against ``devices.list``; this module decides which devices need one and how to undo it.

Why a module of its own beside :mod:`..cgroup_v1`: that one is the kernel mechanism, which the
sandbox runtime shares; this one is the engine's layer (the journal, the verdicts) and may
import what the sandbox runtime must not (an import-linter contract keeps the two apart).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .. import cgroup_v1
from ..cgroups import CgroupMount
from ..devrules import RW, CharDevice, DevType, effective_access
from ..journal import Journal
from . import Verdict

__all__ = ["V1Controller"]


@dataclass(frozen=True)
class V1Controller:
    """The devices of the container whose v1 ``devices`` cgroup is ``scope`` (and all below)."""

    scope: Path

    @staticmethod
    def confines(directory: Path, mount: CgroupMount | None) -> bool:
        """Whether the v1 devices controller restricts the cgroup ``directory`` at all.

        The root cgroup, and any cgroup still in deny-list mode (``a *:* rwm`` in its list,
        as for a privileged container), allow every device: there is nothing to grant there,
        and a deny written there would hit every process below it — for the root, the whole
        host. Such a layer is left alone.
        """
        if mount is not None and directory == mount.mount_point:
            return False
        rules = cgroup_v1.read_allow_list(directory)
        return not any(rule.type is DevType.ALL for rule in rules)

    @property
    def top(self) -> Path:
        return self.scope

    def granted(self, devices: Collection[CharDevice]) -> dict[CharDevice, Verdict]:
        rules = cgroup_v1.read_allow_list(self.scope)
        verdicts = {}
        for device in devices:
            allowed = effective_access(rules, DevType.CHAR, device.major, device.minor) & RW == RW
            verdicts[device] = Verdict(allowed, allowed, ours=device.rule(RW) in rules)
        return verdicts

    def grant(self, devices: Collection[CharDevice], journal: Journal) -> None:
        new = [d for d in devices if cgroup_v1.allowed(self.scope, d) & RW != RW]
        if not new:
            return
        # The writes go one cgroup after another and may stop half-way: undo first.
        journal.undo_with(
            f"v1 deny {new} on {self.scope}", partial(cgroup_v1.revoke, self.scope, new)
        )
        change = cgroup_v1.grant(self.scope, new)
        journal.record("v1 allow", new, self.scope, change)

    def revoke(self, devices: Collection[CharDevice], journal: Journal) -> None:
        if not self.scope.is_dir():
            return  # the container's cgroup went away with its last process
        # Only what is allowed now: a deny for anything else changes nothing and could take
        # away a device the runtime gave the container itself.
        was = [d for d in devices if cgroup_v1.allowed(self.scope, d) & RW]
        if not was:
            return
        change = cgroup_v1.revoke(self.scope, was)
        journal.undo_with(
            f"v1 re-allow {was} on {self.scope}", partial(cgroup_v1.grant, self.scope, was)
        )
        journal.record("v1 deny", was, self.scope, change)
