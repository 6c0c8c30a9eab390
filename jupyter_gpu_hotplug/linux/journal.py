"""The host changes of one engine call: each logged as it is made, undone newest first.

Why it exists: a grant or revoke changes up to four things on the host (the v1 list, the v2
device programs, a systemd unit's ``DeviceAllow=``, the nodes in the container's ``/dev``),
and any step may fail after others succeeded. Every step — the engine's own and each device
controller's (:mod:`.device_controllers`) — writes its compensating action here the moment it
is committed to, so the engine can put the host back exactly as it was, in reverse order,
whatever step failed. The same record is the call's result (what changed) and its audit log
(one greppable shape, ``host change: <action> <devices> for <whom> at <path>``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from . import cgroup_v1, cgroup_v2, systemd_units

__all__ = ["Change", "Journal"]

log = logging.getLogger(__name__)
"""Every host change is logged under this one name, whichever step made it."""

Change = cgroup_v1.V1Change | cgroup_v2.GrantChange | systemd_units.RecordChange
"""What one controller write reports: the v1 writes, a v2 program swap, a unit's list."""


class Journal:
    """The changes of one engine call, for ``subject`` (``pid 123``, ``an empty cgroup``).

    ``pid`` goes into each log record's ``extra`` when the changes are made for a process.
    """

    def __init__(self, subject: str, *, pid: int | None = None) -> None:
        self._subject = subject
        self._extra: dict[str, object] = {} if pid is None else {"pid": pid}
        self._undo: list[tuple[str, Callable[[], object]]] = []
        self.changes: list[Change] = []

    @classmethod
    def for_process(cls, pid: int) -> Journal:
        return cls(f"pid {pid}", pid=pid)

    def undo_with(self, what: str, action: Callable[[], object]) -> None:
        """Push ``action`` (described by ``what``) to be run if a later step fails. A step
        that may fail half-way pushes its undo *before* it runs, one that is all or nothing
        after."""
        self._undo.append((what, action))

    def record(
        self, action: str, devices: Iterable[object], where: Path, change: Change | None = None
    ) -> None:
        """Log a change made to the host (and keep the controller's report of it)."""
        if change is not None:
            self.changes.append(change)
        log.info(
            "host change: %s %s for %s at %s",
            action,
            " ".join(str(d) for d in devices),
            self._subject,
            where,
            extra={"hotplug_action": action, "path": str(where), **self._extra},
        )

    def roll_back(self) -> list[str]:
        """Run every undo action, newest first; what could not be undone, as messages (every
        failure is reported to the caller, none is hidden or stops the others)."""
        failures = []
        for what, action in reversed(self._undo):
            try:
                action()
            except Exception as e:
                log.error("rollback step failed: %s: %s", what, e)
                failures.append(f"{what}: {e}")
        self._undo.clear()
        return failures
