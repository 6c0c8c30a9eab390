"""The ledger as the event loop uses it: writes in the ledger's thread, reads from memory.

Why it exists: every ledger write is a disk transaction (a WAL write, and an ``fsync`` at each
checkpoint), and the ledger serialises its callers, so under load its thread is busy. If reads
queued behind the writes, a ``GET /v1/gpus`` or a request that is refused anyway would wait for
other targets' commits. But this agent is the ledger's only writer (the state dir's lock
guarantees it), so it can keep an exact copy of the attachments in memory: loaded once, then
updated from what each write returns. Reads (the views, the per-target limit, the idempotency
check, a quick "not enough free GPUs") come from the copy; every decision that matters is still
made by the ledger itself inside its transaction (``reserve`` checks again, and raises the same
errors).

The copy is touched only on the event loop's thread (after each awaited write), so it needs no
lock. A write that fails for a reason other than the API errors the ledger raises on purpose
(``LedgerError``: storage trouble) reloads the copy from the database, so it cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TypeVar

from .._structs import GpuUuid, RequestId, Target
from .ledger import GpuRecord, Ledger, LedgerEntry, LedgerError
from .workers import Workers

__all__ = ["Books"]

_T = TypeVar("_T")


class Books:
    """The ledger's writes (awaited, in its thread) and an in-memory copy for reads."""

    def __init__(self, ledger: Ledger, workers: Workers) -> None:
        self._ledger = ledger
        self._workers = workers
        self._entries: dict[GpuUuid, LedgerEntry] | None = None

    async def load(self) -> None:
        """Read every attachment from the database into the copy (at start, after trouble)."""
        entries = await self._workers.ledger(self._ledger.attachments)
        self._entries = {entry.gpu.uuid: entry for entry in entries}

    @property
    def _copy(self) -> dict[GpuUuid, LedgerEntry]:
        if self._entries is None:
            raise RuntimeError("Books.load() must run before the books are read")
        return self._entries

    # --- reads (from memory) ---------------------------------------------------------------

    def attachments(self, target: Target | None = None) -> list[LedgerEntry]:
        """As ``Ledger.attachments``: all, or one target's, in GPU index order."""
        entries = [
            entry
            for entry in self._copy.values()
            if target is None or entry.target.key == target.key
        ]
        return sorted(entries, key=lambda entry: (entry.gpu.index, entry.gpu.uuid))

    def get(self, uuid: GpuUuid) -> LedgerEntry | None:
        return self._copy.get(uuid)

    def free(self, candidates: Sequence[GpuRecord]) -> list[GpuRecord]:
        """Those of ``candidates`` that no attachment holds, in the order given."""
        return [gpu for gpu in candidates if gpu.uuid not in self._copy]

    # --- writes (durable, then mirrored) ---------------------------------------------------

    async def reserve(
        self,
        target: Target,
        count: int,
        *,
        candidates: Sequence[GpuRecord],
        request_id: RequestId | None = None,
    ) -> list[LedgerEntry]:
        entries = await self._write(
            self._ledger.reserve, target, count, candidates=candidates, request_id=request_id
        )
        self._put(entries)
        return entries

    async def mark_granted(self, uuids: Collection[GpuUuid]) -> list[LedgerEntry]:
        entries = await self._write(self._ledger.mark_granted, uuids)
        self._put(entries)
        return entries

    async def begin_release(self, uuid: GpuUuid) -> LedgerEntry:
        entry = await self._write(self._ledger.begin_release, uuid)
        self._put([entry])
        return entry

    async def cancel_release(self, uuids: Collection[GpuUuid]) -> list[LedgerEntry]:
        entries = await self._write(self._ledger.cancel_release, uuids)
        self._put(entries)
        return entries

    async def release(self, uuids: Iterable[GpuUuid]) -> None:
        gone = list(uuids)
        await self._write(self._ledger.release, gone)
        for uuid in gone:
            self._copy.pop(uuid, None)

    async def known_gpus(self) -> list[GpuRecord]:
        return await self._workers.ledger(self._ledger.known_gpus)

    async def check(self) -> None:
        """A cheap read of the database itself (the health probe)."""
        await self._workers.ledger(self._ledger.pending)

    def _put(self, entries: Iterable[LedgerEntry]) -> None:
        self._copy.update((entry.gpu.uuid, entry) for entry in entries)

    async def _write(self, function: Callable[..., _T], /, *args: object, **kwargs: object) -> _T:
        try:
            return await self._workers.ledger(function, *args, **kwargs)
        except LedgerError:
            # Storage trouble: what was committed is unknown, so read it back.
            await self.load()
            raise
