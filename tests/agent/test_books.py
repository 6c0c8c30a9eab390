"""The ledger's in-memory copy (``Books``) and the ledger transition it relies on to undo a
refused release (``Ledger.cancel_release``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PidTarget
from jupyter_gpu_hotplug.agent.books import Books
from jupyter_gpu_hotplug.agent.ledger import (
    EntryState,
    GpuRecord,
    Ledger,
    LedgerError,
    LedgerStateError,
)
from jupyter_gpu_hotplug.agent.workers import Workers

GPUS = [GpuRecord(GpuUuid(f"GPU-{i:08x}-0000-4000-8000-000000000000"), i, i, "g") for i in range(3)]
KERNEL = PidTarget(100, 1)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger.open(tmp_path / "state") as opened:
        yield opened


def test_cancel_release_gives_the_gpu_back(ledger: Ledger) -> None:
    (entry,) = ledger.reserve(KERNEL, 1, candidates=GPUS)
    ledger.mark_granted([entry.gpu.uuid])
    ledger.begin_release(entry.gpu.uuid)

    (back,) = ledger.cancel_release([entry.gpu.uuid])

    assert back.state is EntryState.GRANTED
    assert back.granted_at is not None
    # Already granted: unchanged.
    assert ledger.cancel_release([entry.gpu.uuid]) == [back]


def test_cancel_release_refuses_what_is_not_being_released(ledger: Ledger) -> None:
    (reserving,) = ledger.reserve(KERNEL, 1, candidates=GPUS)

    with pytest.raises(LedgerStateError, match="reserving"):
        ledger.cancel_release([reserving.gpu.uuid])
    with pytest.raises(LedgerStateError, match="not attached"):
        ledger.cancel_release([GPUS[2].uuid])
    (entry,) = ledger.attachments()
    assert entry.state is EntryState.RESERVING


async def test_books_follow_every_write(ledger: Ledger) -> None:
    workers = Workers()
    try:
        books = Books(ledger, workers)
        await books.load()
        (entry,) = await books.reserve(KERNEL, 1, candidates=GPUS)
        assert books.attachments() == ledger.attachments()
        await books.mark_granted([entry.gpu.uuid])
        await books.begin_release(entry.gpu.uuid)
        await books.cancel_release([entry.gpu.uuid])
        assert books.attachments(KERNEL) == ledger.attachments(KERNEL)
        assert books.free(GPUS) == GPUS[1:]
        assert books.get(entry.gpu.uuid) == ledger.get(entry.gpu.uuid)
        await books.release([entry.gpu.uuid])
        assert books.attachments() == [] == ledger.attachments()
    finally:
        workers.shutdown()


async def test_books_reload_after_storage_trouble(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    workers = Workers()
    try:
        books = Books(ledger, workers)
        await books.load()
        (entry,) = await books.reserve(KERNEL, 1, candidates=GPUS)
        committed = ledger.mark_granted

        def commits_then_fails(uuids: list[GpuUuid]) -> object:
            committed(uuids)
            raise LedgerError("disk I/O error after the commit")

        monkeypatch.setattr(ledger, "mark_granted", commits_then_fails)

        with pytest.raises(LedgerError):
            await books.mark_granted([entry.gpu.uuid])

        assert books.attachments() == ledger.attachments()
        assert books.attachments()[0].state is EntryState.GRANTED
    finally:
        workers.shutdown()


def test_books_must_be_loaded_first(ledger: Ledger) -> None:
    workers = Workers()
    try:
        with pytest.raises(RuntimeError, match="load"):
            Books(ledger, workers).attachments()
    finally:
        workers.shutdown()
