"""Why a kernel's GPU went away, when nobody on this page asked: the release log.

Boundary: pure bookkeeping over successive readings (a kernel's target and its attachments)
plus what the caller learnt about the loss (the agent's recent idle releases, this server's
own detaches). No I/O, no asyncio.

Why: the frontend used to announce every GPU it had not detached itself as "released (the
kernel restarted or the GPU sat unused)" — wrong after the user's own ``%gpu detach all``
(which goes from the kernel to the agent, past this server) or an operator's CLI detach. The
server sees each reading of each watched kernel, so it can tell the cases apart: the
kernel's sandbox changed (a restart), the agent's idle policy took it (its idle releases),
a page of this server detached it, or something else did (the magic, the command line).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Final, Literal, TypedDict

from .._structs import PidRef
from ..client import Attachment

__all__ = ["RELEASE_MEMORY_S", "ReleaseLog", "ReleaseReason", "ReleasedJson"]

ReleaseReason = Literal["kernel_restarted", "idle", "detached_here", "detached_elsewhere"]

RELEASE_MEMORY_S: Final = 300.0
"""How long a release stays in the readings (a page reloaded meanwhile still learns why)."""


class ReleasedJson(TypedDict):
    """One GPU a kernel lost lately, and why (``released`` of ``GET gpus``)."""

    uuid: str
    index: int
    reason: ReleaseReason
    released_at: float
    """Seconds since the epoch when this server noticed it."""


@dataclass
class _Seen:
    target: PidRef | None
    attached: dict[str, Attachment]


@dataclass
class ReleaseLog:
    """Per kernel: what its last reading held, and its recent releases."""

    clock: Callable[[], float] = time.time
    _seen: dict[str | None, _Seen] = field(default_factory=dict)
    _released: dict[str | None, list[ReleasedJson]] = field(default_factory=dict)
    _detached_here: dict[str, float] = field(default_factory=dict)

    def detached_here(self, uuids: Iterable[str]) -> None:
        """A page of this server is detaching these GPUs (its REST API): that is their
        reason. Marked before the agent is asked, so that a reading taken meanwhile knows."""
        now = self.clock()
        for uuid in uuids:
            self._detached_here[uuid] = now

    def held(self, kernel_id: str | None) -> list[str]:
        """The GPUs ``kernel_id`` held at its last reading (what a "detach all" takes)."""
        seen = self._seen.get(kernel_id)
        return [] if seen is None else list(seen.attached)

    def not_detached_here(self, uuids: Iterable[str]) -> None:
        """That detach failed: the GPUs stay, and a later loss has another reason."""
        for uuid in uuids:
            self._detached_here.pop(uuid, None)

    def lost(
        self, kernel_id: str | None, target: PidRef | None, attached: Iterable[Attachment]
    ) -> tuple[PidRef | None, list[Attachment]] | None:
        """Record a reading; the previous target and the GPUs it lost since, if any (the
        caller then finds out whether the idle policy took them, and calls ``explain``)."""
        now: dict[str, Attachment] = {attachment.uuid: attachment for attachment in attached}
        before = self._seen.get(kernel_id)
        self._seen[kernel_id] = _Seen(target, now)
        if before is None:
            return None
        gone = [a for uuid, a in before.attached.items() if uuid not in now]
        return (before.target, gone) if gone else None

    def explain(
        self,
        kernel_id: str | None,
        *,
        target: PidRef | None,
        before: PidRef | None,
        gone: Iterable[Attachment],
        idle: Collection[str],
    ) -> None:
        """Record why each of ``gone`` left ``kernel_id`` (``idle``: the UUIDs the agent's idle
        policy took back from ``before`` lately)."""
        at = self.clock()
        log = self._released.setdefault(kernel_id, [])
        for attachment in gone:
            reason: ReleaseReason
            if self._detached_here.pop(attachment.uuid, None) is not None:
                reason = "detached_here"
            elif before != target:
                reason = "kernel_restarted"
            elif attachment.uuid in idle:
                reason = "idle"
            else:
                reason = "detached_elsewhere"
            log.append(
                ReleasedJson(
                    uuid=attachment.uuid, index=attachment.index, reason=reason, released_at=at
                )
            )

    def recent(self, kernel_id: str | None) -> list[ReleasedJson]:
        """``kernel_id``'s releases of the last ``RELEASE_MEMORY_S``, oldest first."""
        since = self.clock() - RELEASE_MEMORY_S
        for uuid, at in list(self._detached_here.items()):
            if at < since:
                del self._detached_here[uuid]
        kept = [r for r in self._released.get(kernel_id, []) if r["released_at"] >= since]
        if kernel_id in self._released:
            self._released[kernel_id] = kept
        return list(kept)
