"""The node's GPU readings of the last hour, kept by the server: the charts' history.

Boundary: pure bookkeeping over NVML snapshots (``nvml.state.Snapshot``); no I/O, no asyncio.

Why the server keeps it: each page used to keep its own five minutes, so a reload emptied
the charts and two notebooks showed different histories of the same GPU. The server reads
the node's GPUs once per interval for every stream anyway; keeping those readings for an
hour costs about a megabyte per GPU (3,600 readings of 9 numbers) and makes the
history the same in every notebook and survive a reload. Readings are taken while a page
watches (the stream's poller runs only then), so a gap means nobody looked.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Final, TypedDict

from ..nvml.state import Snapshot

__all__ = ["HISTORY_SECONDS", "GpuHistory", "HistoryJson"]

HISTORY_SECONDS: Final = 3600.0
"""How far back the history reaches: the panel's longest window (1 h)."""

Reading = tuple[
    float,
    int | None,
    int | None,
    int | None,
    int | None,
    int | None,
    int | None,
    int | None,
    int | None,
]
"""``(taken_at, utilization %, memory bandwidth %, memory used, memory total, PCIe TX, PCIe
RX, NVLink TX, NVLink RX)``: bytes and bytes/s; ``None`` where NVML gave nothing (NVLink on a
GPU without it)."""


class HistoryJson(TypedDict):
    """``GET history``: per GPU UUID, its readings, oldest first."""

    seconds: float
    """How far back it reaches at most."""
    columns: list[str]
    gpus: dict[str, list[Reading]]


COLUMNS: Final = [
    "taken_at",
    "utilization_gpu",
    "utilization_memory",
    "memory_used",
    "memory_total",
    "pcie_tx",
    "pcie_rx",
    "nvlink_tx",
    "nvlink_rx",
]


class GpuHistory:
    """The last ``seconds`` of readings per GPU; at most one reading per ``min_gap`` s (the
    REST ``GET gpus`` reads too, between the poller's readings)."""

    def __init__(self, *, seconds: float = HISTORY_SECONDS, min_gap: float = 0.5) -> None:
        self._seconds = seconds
        self._min_gap = min_gap
        self._by_uuid: dict[str, collections.deque[Reading]] = {}

    def record(self, snapshot: Snapshot) -> None:
        """Add the snapshot's readings of every GPU with a UUID; forget what is too old."""
        at = snapshot.taken_at
        for gpu in snapshot.gpus:
            if gpu.uuid is None:
                continue
            readings = self._by_uuid.setdefault(gpu.uuid, collections.deque())
            if readings and at - readings[-1][0] < self._min_gap:
                continue
            readings.append(
                (
                    at,
                    gpu.utilization_gpu,
                    gpu.utilization_memory,
                    gpu.memory_used,
                    gpu.memory_total,
                    gpu.pcie_tx,
                    gpu.pcie_rx,
                    gpu.nvlink_tx,
                    gpu.nvlink_rx,
                )
            )
        self._forget(before=at - self._seconds)

    def _forget(self, *, before: float) -> None:
        for uuid, readings in list(self._by_uuid.items()):
            while readings and readings[0][0] < before:
                readings.popleft()
            if not readings:
                del self._by_uuid[uuid]

    def json(self, uuids: Iterable[str] | None = None) -> HistoryJson:
        """The readings of ``uuids`` (default: every GPU seen lately)."""
        wanted = self._by_uuid.keys() if uuids is None else uuids
        return HistoryJson(
            seconds=self._seconds,
            columns=list(COLUMNS),
            gpus={uuid: list(self._by_uuid[uuid]) for uuid in wanted if uuid in self._by_uuid},
        )
