"""The node's GPUs as the agent needs them: which exist, their minor numbers, who uses them.

Why it exists: the agent hands out GPUs by UUID but grants them by driver minor
(``/dev/nvidia<minor>``), and must know which processes use a GPU before taking it away. The
answers come from NVML, read in exactly one place for the whole product
(``nvml.state.GpuMonitor``); this module only turns its snapshots into the agent's terms and
sorts the GPUs that may be handed out from those that may not.

The inventory is live (STYLE 10): every ``snapshot()`` asks NVML again, nothing is cached at
import or start-up. It asks only what the agent uses — who each GPU is and whether it answers
(``GpuMonitor.roster``), and who uses one GPU (``GpuMonitor.processes``) — never the metrics:
every attach reads the inventory, so its cost is on every attach's path.

It never raises for a GPU's failure: a GPU that fell off the bus, or whose UUID or minor NVML
cannot give, is reported as lost (with what was last known of it) and is never handed out; when
NVML cannot be used at all (no driver), the node has no GPUs and ``unavailable`` says why. With
``--simulate`` the same code reads the fake ``libnvidia-ml.so.1`` of ``nvml.sim``, and the GPUs
are marked ``simulated``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..._structs import GpuKind, GpuUuid
from ...nvml.state import GpuIdentity, GpuMonitor, MigSlice, NvmlStatus

__all__ = ["GpuDevice", "Inventory", "InventorySnapshot", "LostGpu", "NvmlInventory"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuDevice:
    """One healthy GPU."""

    uuid: GpuUuid
    index: int
    """NVML index (enumeration order, not the minor)."""
    minor: int
    """Driver minor: the GPU's node is ``/dev/nvidia<minor>``."""
    name: str
    memory_total: int
    """Bytes."""
    simulated: bool
    mig: MigSlice | None = None
    """Set for a MIG slice: ``uuid`` is its ``MIG-`` UUID, ``minor`` its GPU's."""
    mig_enabled: bool = False
    """A GPU in MIG mode: handed out only as slices, never whole."""

    @property
    def whole(self) -> bool:
        """A GPU that can be handed out as one."""
        return self.mig is None and not self.mig_enabled

    @property
    def kind(self) -> GpuKind:
        """What ``GET /v1/gpus`` says it is: the one place that tells a whole GPU from a GPU
        in MIG mode and its slices for every client."""
        if self.mig is not None:
            return "mig_slice"
        return "mig_parent" if self.mig_enabled else "gpu"


@dataclass(frozen=True)
class LostGpu:
    """A GPU NVML enumerates but the agent cannot hand out (fallen off the bus, unreadable)."""

    index: int
    reason: str
    last_known: GpuDevice | None
    """What it was when it last answered, if it ever did in this agent's life."""


@dataclass(frozen=True)
class InventorySnapshot:
    """The node's GPUs at one moment."""

    gpus: tuple[GpuDevice, ...]
    """Healthy GPUs in NVML index order: the only ones that may be handed out."""
    lost: tuple[LostGpu, ...] = ()
    unavailable: str | None = None
    """Why NVML could not be asked at all (no driver...); then ``gpus`` is empty."""

    def by_uuid(self, uuid: GpuUuid) -> GpuDevice | None:
        return next((gpu for gpu in self.gpus if gpu.uuid == uuid), None)


class Inventory(Protocol):
    """The node's GPUs. Calls block (NVML); run them in a thread."""

    def snapshot(self) -> InventorySnapshot:
        """The GPUs now; never raises for a GPU's or the driver's failure."""

    def running_pids(self, minor: int) -> list[int]:
        """Pids NVML lists as running on the GPU with this minor (empty if unknown)."""

    def used_memory(self, minor: int) -> dict[int, int | None]:
        """The device memory NVML says each process on the GPU with this minor uses, by pid
        (None where NVML does not say; empty if unknown)."""


class NvmlInventory:
    """``Inventory`` over ``nvml.state.GpuMonitor``. Thread-safe; ``close()`` releases NVML.

    ``dev_dir`` is where the host's GPU nodes are (``/dev``; ``/host/dev`` in a pod): the
    monitor re-initialises NVML when they change, so a GPU added to the host is seen.
    """

    def __init__(self, *, dev_dir: Path = Path("/dev"), retry_interval: float = 5.0) -> None:
        self._monitor = GpuMonitor(dev_dir=dev_dir, retry_interval=retry_interval)
        self._lock = threading.Lock()
        self._last_seen: dict[int, GpuDevice] = {}
        self._reported: dict[int, str] = {}
        self._unavailable: str | None = None

    def close(self) -> None:
        self._monitor.close()

    def snapshot(self) -> InventorySnapshot:
        snap = self._monitor.roster(slices=True)
        if snap.status not in (NvmlStatus.OK, NvmlStatus.NO_GPU):
            self._note_unavailable(snap.message)
            return InventorySnapshot(gpus=(), unavailable=snap.message)
        self._note_unavailable(None)
        gpus: list[GpuDevice] = []
        lost: list[LostGpu] = []
        for gpu in snap.gpus:
            device, reason = _device(gpu)
            if device is not None:
                gpus.append(device)
            elif gpu.mig is None:  # a lost slice is its lost GPU's business
                lost.append(self._lost(gpu.index, reason))
        self._note_healthy([gpu for gpu in gpus if gpu.mig is None])
        return InventorySnapshot(gpus=tuple(gpus), lost=tuple(lost))

    def running_pids(self, minor: int) -> list[int]:
        return sorted(process.pid for process in self._monitor.processes(minor) or ())

    def used_memory(self, minor: int) -> dict[int, int | None]:
        return {p.pid: p.used_memory for p in self._monitor.processes(minor) or ()}

    def utilization(self) -> dict[GpuUuid, int | None]:
        """GPU utilisation in percent by UUID, from one NVML snapshot (the idle policy's
        ``Usage``); ``None`` where NVML cannot say."""
        return {
            gpu.uuid: gpu.utilization_gpu
            for gpu in self._monitor.snapshot().gpus
            if gpu.uuid is not None
        }

    # --- what changed, for the log ---------------------------------------------------------

    def _note_unavailable(self, reason: str | None) -> None:
        with self._lock:
            changed, self._unavailable = reason != self._unavailable, reason
        if changed and reason is not None:
            log.warning("NVML cannot be used: %s; this node reports no GPUs until it can", reason)
        elif changed:
            log.info("NVML answers again")

    def _lost(self, index: int, reason: str) -> LostGpu:
        with self._lock:
            last = self._last_seen.get(index)
            first_time = self._reported.get(index) != reason
            self._reported[index] = reason
        if first_time:
            what = f"GPU {last.uuid} (minor {last.minor})" if last else f"GPU at index {index}"
            log.error("%s is %s; it will not be handed out", what, reason)
        return LostGpu(index=index, reason=reason, last_known=last)

    def _note_healthy(self, gpus: list[GpuDevice]) -> None:
        with self._lock:
            recovered = [gpu for gpu in gpus if self._reported.pop(gpu.index, None) is not None]
            self._last_seen.update({gpu.index: gpu for gpu in gpus})
        for gpu in recovered:
            log.warning("GPU %s (minor %d) answers again", gpu.uuid, gpu.minor)


def _device(gpu: GpuIdentity) -> tuple[GpuDevice | None, str]:
    """The healthy GPU ``gpu`` describes, or why it cannot be handed out."""
    if gpu.lost:
        return None, "lost (NVML: GPU is lost)"
    if gpu.uuid is None or gpu.minor is None:
        return None, "unreadable (NVML gives no UUID or minor number)"
    return (
        GpuDevice(
            uuid=gpu.uuid,
            index=gpu.index,
            minor=gpu.minor,
            name=gpu.name or "NVIDIA GPU",
            memory_total=gpu.memory_total or 0,
            simulated=gpu.simulated,
            mig=gpu.mig,
            mig_enabled=gpu.mig_enabled,
        ),
        "",
    )
