"""Local mode's ``Allocator``: the SQLite ledger, written in its thread, read from memory.

Why it exists: every ledger write is a disk transaction (a WAL write, and an ``fsync`` at each
checkpoint), and the ledger serialises its callers, so under load its thread is busy. If reads
queued behind the writes, a ``GET /v1/gpus`` or a request that is refused anyway would wait for
other targets' commits. But this agent is the ledger's only writer (the state dir's lock
guarantees it), so it can keep an exact copy of the reservations in memory: loaded once, then
updated from what each write returns. Reads (the views, the per-target limit, the service's
idempotency check, a quick "not enough free GPUs") come from the copy; every decision that
matters is still made by the ledger itself inside its transaction (``reserve`` checks again,
and raises the same errors).

The copy is touched only on the event loop's thread (after each awaited write), so it needs no
lock. A write that fails for a reason other than the API errors the ledger raises on purpose
(``LedgerError``: storage trouble) reloads the copy from the database, so it cannot drift.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TypeVar

from ..._structs import GpuUuid, RequestId, Target
from ..core.errors import Timeout
from ..core.seams import GpuRecord, HostContainer, Reservation
from ..core.workers import Workers
from .ledger import Ledger, LedgerError

__all__ = ["LedgerAllocator"]

_T = TypeVar("_T")


class LedgerAllocator:
    """``Allocator`` over a ``Ledger`` (see the module docstring)."""

    selectable = True
    """The ledger reserves from exactly the candidates it is given: a request may name GPUs."""

    def __init__(self, ledger: Ledger, workers: Workers) -> None:
        self._ledger = ledger
        self._workers = workers
        self._entries: dict[GpuUuid, Reservation] | None = None

    async def load(self) -> None:
        """Read every reservation from the database into the copy (at start, after trouble)."""
        entries = await self._workers.ledger(self._ledger.attachments)
        self._entries = {entry.gpu.uuid: entry for entry in entries}

    @property
    def _copy(self) -> dict[GpuUuid, Reservation]:
        if self._entries is None:
            raise RuntimeError("LedgerAllocator.load() must run before it is read")
        return self._entries

    # --- reads (from memory) ---------------------------------------------------------------

    def attachments_of(self, target: Target) -> list[Reservation]:
        return _ordered(entry for entry in self._copy.values() if entry.target.key == target.key)

    def all_attachments(self) -> list[Reservation]:
        return _ordered(self._copy.values())

    def get(self, uuid: GpuUuid) -> Reservation | None:
        return self._copy.get(uuid)

    async def available(self, candidates: Sequence[GpuRecord]) -> list[GpuRecord]:
        """NVML's GPUs (``candidates``) less the reservations: the agent is the only one that
        hands GPUs out on this node."""
        return [gpu for gpu in candidates if gpu.uuid not in self._copy]

    # --- writes (durable, then mirrored) ---------------------------------------------------

    async def reserve(
        self,
        container: HostContainer,
        count: int,
        *,
        request_id: RequestId | None,
        deadline: float,
        candidates: Sequence[GpuRecord],
    ) -> list[Reservation]:
        if time.monotonic() > deadline:
            # Nothing was written: a local reservation is one transaction, never half-made.
            raise Timeout(
                f"the wait for {count} GPU(s) for {container} ran out before the ledger answered",
                wait_seconds=0,
            )
        entries = await self._write(
            self._ledger.reserve,
            container.target,
            count,
            container=container.key,
            candidates=candidates,
            request_id=request_id,
        )
        self._put(entries)
        return entries

    async def intend_grant(
        self, uuids: Collection[GpuUuid], *, nodes_created: Collection[GpuUuid] = ()
    ) -> None:
        # The ledger's rows stay "reserving" (a restart rolls the attach back); only the nodes'
        # intent is written, and nothing at all when the grant makes none.
        if nodes_created:
            self._put(await self._write(self._ledger.intend_nodes, nodes_created))

    async def mark_granted(
        self, uuids: Collection[GpuUuid], *, nodes_created: Collection[GpuUuid] = ()
    ) -> list[Reservation]:
        entries = await self._write(self._ledger.mark_granted, uuids, nodes_created=nodes_created)
        self._put(entries)
        return entries

    async def begin_release(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        entries = await self._write(self._ledger.begin_release, uuids)
        self._put(entries)
        return entries

    async def cancel_release(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        entries = await self._write(self._ledger.cancel_release, uuids)
        self._put(entries)
        return entries

    async def rebind(
        self, uuids: Collection[GpuUuid], container: HostContainer
    ) -> list[Reservation]:
        entries = await self._write(self._ledger.rebind, uuids, container.target, container.key)
        self._put(entries)
        return entries

    async def release(self, uuids: Collection[GpuUuid]) -> None:
        gone = list(uuids)
        await self._write(self._ledger.release, gone)
        for uuid in gone:
            self._copy.pop(uuid, None)

    async def check(self) -> None:
        await self._workers.ledger(self._ledger.pending)

    def _put(self, entries: Iterable[Reservation]) -> None:
        self._copy.update((entry.gpu.uuid, entry) for entry in entries)

    async def _write(self, function: Callable[..., _T], /, *args: object, **kwargs: object) -> _T:
        try:
            return await self._workers.ledger(function, *args, **kwargs)
        except LedgerError:
            # Storage trouble: what was committed is unknown, so read it back.
            await self.load()
            raise


def _ordered(entries: Iterable[Reservation]) -> list[Reservation]:
    return sorted(entries, key=lambda entry: (entry.gpu.index, entry.gpu.uuid))
