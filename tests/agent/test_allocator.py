"""The allocator contract (``allocator_contract.py``: every transition of the one table,
``seams.TRANSITIONS``) run over the ledger and over the tests' in-memory allocator, and the
ledger's in-memory copy (``LedgerAllocator``) kept exact."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PidTarget
from jupyter_gpu_hotplug.agent.core.seams import (
    ContainerCgroups,
    ContainerKey,
    GpuRecord,
    HostContainer,
    Reservation,
    ReservationState,
)
from jupyter_gpu_hotplug.agent.core.workers import Workers
from jupyter_gpu_hotplug.agent.local.allocator import LedgerAllocator
from jupyter_gpu_hotplug.agent.local.ledger import Ledger, LedgerError

from .allocator_contract import AllocatorContract, AllocatorSetup
from .fakes import FakeHost, MemoryAllocator

GPUS = [GpuRecord(GpuUuid(f"GPU-{i:08x}-0000-4000-8000-000000000000"), i, i, "g") for i in range(3)]
GPUS_4 = [
    GpuRecord(GpuUuid(f"GPU-{i:08x}-0000-4000-8000-000000000000"), i, i, "g") for i in range(4)
]
KERNEL = PidTarget(100, 1)
KEY = ContainerKey("local:test-container")


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger.open(tmp_path / "state") as opened:
        yield opened


def host_container() -> HostContainer:
    return HostContainer(
        target=KERNEL,
        key=KEY,
        pid=KERNEL.pid,
        start_time=KERNEL.start_time,
        cgroups=ContainerCgroups("/k", "/k"),
        label="process 100",
    )


async def test_allocator_follows_every_write(ledger: Ledger) -> None:
    workers = Workers()
    try:
        allocator = LedgerAllocator(ledger, workers)
        await allocator.load()
        (entry,) = await allocator.reserve(
            host_container(), 1, request_id=None, deadline=math.inf, candidates=GPUS
        )
        assert allocator.all_attachments() == ledger.attachments()
        await allocator.mark_granted([entry.gpu.uuid])
        await allocator.begin_release([entry.gpu.uuid])
        await allocator.cancel_release([entry.gpu.uuid])
        assert allocator.attachments_of(KERNEL) == ledger.attachments(KERNEL)
        assert allocator.get(entry.gpu.uuid) == ledger.get(entry.gpu.uuid)
        await allocator.release([entry.gpu.uuid])
        assert allocator.all_attachments() == [] == ledger.attachments()
    finally:
        workers.shutdown()


async def test_allocator_reloads_after_storage_trouble(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    workers = Workers()
    try:
        allocator = LedgerAllocator(ledger, workers)
        await allocator.load()
        (entry,) = await allocator.reserve(
            host_container(), 1, request_id=None, deadline=math.inf, candidates=GPUS
        )
        committed = ledger.mark_granted

        def commits_then_fails(uuids: list[GpuUuid], **kwargs: object) -> object:
            committed(uuids)
            raise LedgerError("disk I/O error after the commit")

        monkeypatch.setattr(ledger, "mark_granted", commits_then_fails)

        with pytest.raises(LedgerError):
            await allocator.mark_granted([entry.gpu.uuid])

        assert allocator.all_attachments() == ledger.attachments()
        assert allocator.all_attachments()[0].state is ReservationState.GRANTED
    finally:
        workers.shutdown()


def test_allocator_must_be_loaded_first(ledger: Ledger) -> None:
    workers = Workers()
    try:
        with pytest.raises(RuntimeError, match="load"):
            LedgerAllocator(ledger, workers).all_attachments()
    finally:
        workers.shutdown()


def _containers(count: int) -> list[HostContainer]:
    host = FakeHost()
    return [host.host_container(host.spawn(100 + n, f"kernel-{n}")) for n in range(count)]


class TestLedgerAllocator(AllocatorContract):
    @pytest.fixture
    def allocator_setup(self, tmp_path: Path, workers: Workers) -> Iterator[AllocatorSetup]:
        opened: list[Ledger] = []

        async def open_fresh() -> LedgerAllocator:
            # A restart: the previous instance lets go of the state dir first.
            if opened:
                opened[-1].close()
            opened.append(Ledger.open(tmp_path / "state"))
            return LedgerAllocator(opened[-1], workers)

        yield AllocatorSetup(open_fresh, _containers(5), GPUS_4)
        for ledger in opened:
            ledger.close()


class TestMemoryAllocator(AllocatorContract):
    """The in-memory fake the reconciler's tests also run over keeps the same contract."""

    @pytest.fixture
    def allocator_setup(self) -> AllocatorSetup:
        store: dict[GpuUuid, Reservation] = {}

        async def open_fresh() -> MemoryAllocator:
            return MemoryAllocator(store)

        return AllocatorSetup(open_fresh, _containers(5), GPUS_4)
