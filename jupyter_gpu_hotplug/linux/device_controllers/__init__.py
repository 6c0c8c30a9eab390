"""One device controller per cgroup version, behind one small interface.

Why it exists: the kernel asks a container's device policy on every ``open()``, and where
that policy lives depends on the cgroup version — an allow list in v1 (``devices.allow`` /
``devices.deny``, :mod:`.v1`), eBPF device programs in v2, plus the ``DeviceAllow=`` list
systemd rebuilds them from when it manages the container's unit (:mod:`.v2`). The engine
(:mod:`..engine`) picks a container's controllers once, when it inspects it (a hybrid host
confines a container with both), and then only calls this interface; nothing of either
version is written anywhere else. The idea is opencontainers/cgroups' ``devices/v1.go`` and
``v2.go`` beside one device-policy model (ours: :mod:`..devrules`).

A controller changes the host only through a :class:`~..journal.Journal`, so each of its
steps is logged and undone, newest first, when a later step of the engine's call fails.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..devrules import CharDevice
from ..journal import Journal

__all__ = ["DeviceController", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """What one controller says of one device for one container."""

    granted: bool | None
    """Our grant is in place here (v1: the list allows it ``rw``; v2: our marked prefix allows
    it on every program that is ours to patch); None: nothing here restricts the device."""
    allows: bool | None
    """The container's own policy here lets it open the device ``rw``, whoever's rule it is;
    None: not confined here, or a program cannot be read as a device program."""
    ours: bool = False
    """The grant looks like this engine's own (v1: exactly ``c M:m rw``, where runtimes write
    ``rwm``; v2: our marked prefix), not a runtime's or a device plugin's."""
    unit_allows: bool | None = None
    """The manager that rebuilds the policy (systemd, from the unit's ``DeviceAllow=``) will
    allow it too; None: no manager keeps a device policy for the container."""
    unit_ours: bool = False
    """The unit's entry for the device is one we added."""


class DeviceController(Protocol):
    """The device policy of one container in one cgroup hierarchy.

    ``grant`` and ``revoke`` are idempotent (what is granted already, or not granted, is left
    alone and not touched by a rollback), push the undo of each change onto the journal and
    raise the mechanism's own errors (``engine._STEP_ERRORS``); the engine turns them into
    its own. A cgroup that went away with the container's last process is skipped.
    """

    @property
    def top(self) -> Path:
        """The container's own cgroup in this hierarchy: busy scans walk from it."""

    def granted(self, devices: Collection[CharDevice]) -> dict[CharDevice, Verdict]:
        """What this hierarchy says of each of ``devices`` now."""

    def grant(self, devices: Collection[CharDevice], journal: Journal) -> None:
        """Let the container open ``devices`` read-write."""

    def revoke(self, devices: Collection[CharDevice], journal: Journal) -> None:
        """Take ``devices`` away from the container; where this hierarchy does not grant one
        now, nothing is written for it."""
