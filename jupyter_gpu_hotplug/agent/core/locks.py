"""One operation at a time per target, and reconciliation that never gets in a caller's way.

Why it exists: an attach and a detach of the same target must not interleave (each is several
steps across the ledger and the host), but operations on different targets must run in
parallel. The rules:

- a caller's operation finding another *operation* on its target is refused at once with 409
  ``busy`` (retryable) rather than queued: the client sees the conflict instead of hanging
  behind an operation it cannot see;
- a caller's operation finding the *reconciler* at work on its target waits for it (a pass
  over one target takes milliseconds): a background repair must never make a request fail;
- the reconciler skips a target that anyone holds and comes back on its next pass.

All callers run on the event loop's thread, so a dict is enough; no thread locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Iterator

from ..._structs import Target, TargetKey
from .errors import Busy

__all__ = ["TargetLocks"]


class _Holder(enum.Enum):
    OPERATION = "operation"
    RECONCILER = "reconciler"


class TargetLocks:
    """Per-target exclusion between operations and the reconciler (see the module docstring)."""

    def __init__(self) -> None:
        self._held: dict[TargetKey, tuple[_Holder, asyncio.Event]] = {}

    @contextlib.asynccontextmanager
    async def operation(self, target: Target) -> AsyncIterator[None]:
        """Hold ``target`` for a caller's operation; ``Busy`` if another operation holds it."""
        while (held := self._held.get(target.key)) is not None:
            holder, released = held
            if holder is _Holder.OPERATION:
                raise Busy.operation_in_progress(str(target))
            await released.wait()
        with self._holding(target, _Holder.OPERATION):
            yield

    @contextlib.contextmanager
    def reconciling(self, target: Target) -> Iterator[bool]:
        """Hold ``target`` for the reconciler if nobody does: yields whether it got it."""
        if target.key in self._held:
            yield False
            return
        with self._holding(target, _Holder.RECONCILER):
            yield True

    @contextlib.contextmanager
    def _holding(self, target: Target, holder: _Holder) -> Iterator[None]:
        released = asyncio.Event()
        self._held[target.key] = (holder, released)
        try:
            yield
        finally:
            del self._held[target.key]
            released.set()

    def is_held(self, target: Target) -> bool:
        return target.key in self._held
