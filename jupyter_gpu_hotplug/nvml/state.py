"""Live GPU state for the notebook side: what every GPU this container can see is doing now.

Boundary: reads NVML (through ``pynvml``), lists the device directory and reads
``/proc/<pid>/comm``; returns frozen values. It knows nothing of the agent: the server
extension, the ``%gpu`` magic and the monitor widget all take their metrics from here, so there
is one place that turns NVML into "uuid, utilisation, memory, temperature, power, PCIe and
NVLink traffic, processes".

Why it exists, and why it re-initialises NVML: a hot-attached GPU appears as a new
``/dev/nvidia<minor>`` in the running container, but NVML enumerates devices when it is
initialised and a long-lived process (a Jupyter server, a kernel) keeps that list forever.
jupyterlab-nvdashboard has exactly this blind spot. So every ``snapshot()`` first lists the
device directory (cheap), and when the set of ``nvidia<N>`` nodes differs from the one NVML
was initialised with, NVML is shut down and initialised again. Nothing is discovered at import
or construction (STYLE 10): a monitor made before any GPU exists starts working when one
arrives.

Two lighter reads serve callers that need no metrics (the node agent hands GPUs out by
identity on every attach, and asks who uses one GPU before taking it away): ``roster()`` reads
who each GPU is and whether it still answers (one NVML query per GPU instead of a snapshot's
ten), ``processes(minor)`` reads the processes of one GPU. Both follow hot-plug and lost GPUs
exactly as ``snapshot()`` does, because all three share the same initialisation and
enumeration.

MIG slices are shown as slices: a GPU in MIG mode is followed, in a snapshot, by each MIG
device this process can see, with ``mig`` saying which GPU and instances it is and its profile
(``1g.10gb``). A slice has its own UUID (``MIG-…``), memory and processes; NVML offers no
utilisation, temperature or power for it (they are the GPU's), so those are ``None``. The
device nodes watched for re-initialisation include ``/dev/nvidia-caps/nvidia-cap<N>``, through
which a MIG device is attached. ``roster(slices=True)`` lists the slices too, for the agent,
which hands them out; ``processes(minor)`` stays with whole GPUs (a GPU's list includes the
processes of its slices).

Failures never escape as exceptions: no NVML library, no driver, or a broken NVML yield an
empty ``Snapshot`` whose ``status`` and ``message`` say why ("no GPU attached: ..."); a GPU
that fell off the bus is reported with ``lost=True``; a metric the GPU or driver does not offer
is ``None``. A failed initialisation is retried when the device nodes change or, at the latest,
after ``retry_interval`` seconds.

NVML keeps one reference-counted initialisation per process. If other code in the process
(the user's own ``pynvml`` in a kernel) holds an initialisation too, shutting down and
initialising again here cannot make the driver re-enumerate; the monitor then sees what that
other holder's view allows.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, NoReturn, Self, TypedDict, TypeVar

import pynvml

from .._structs import GpuUuid
from .sim.config import SIMULATED_SUFFIX
from .sim.runtime import is_fake_library

__all__ = [
    "GpuIdentity",
    "GpuMetricsJson",
    "GpuMonitor",
    "GpuProcess",
    "GpuProcessJson",
    "GpuState",
    "GpuStateJson",
    "MigSlice",
    "MigSliceJson",
    "NvmlStatus",
    "Roster",
    "Snapshot",
    "SnapshotJson",
]

_GPU_NODE: Final = re.compile(r"nvidia[0-9]+")
_CAPS_DIR: Final = "nvidia-caps"
_CAPS_NODE: Final = re.compile(r"nvidia-cap[0-9]+")
_MIG_PROFILE_PREFIX: Final = "MIG "
"""NVML names GPU instance profiles ``MIG 1g.10gb``; the profile is the rest."""
_MILLIWATTS_PER_WATT: Final = 1000.0
PROCESS_SAMPLE_SECONDS: Final = 10.0
"""How far back a process's utilisation samples count: NVML keeps a short ring of samples
per GPU; a few seconds cover several of them without reaching back to a finished run."""
_MICROSECONDS: Final = 1_000_000
_BYTES_PER_KB: Final = 1024
"""NVML's PCIe throughput is in "KB/s" and its NVLink counts in KiB; both are 1024 bytes."""
_ALL_LINKS: Final = 0xFFFFFFFF
"""``scopeId`` of an NVLink throughput field for the sum over all links (``UINT_MAX``)."""
_NVLINK_FIELDS: Final = (
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, _ALL_LINKS),
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, _ALL_LINKS),
)
_T = TypeVar("_T")

# NVML answers that mean "this one value is not available here", not "NVML is broken": the GPU
# lacks the sensor (NOT_SUPPORTED), the container may not read it (NO_PERMISSION), the driver
# predates the call (FUNCTION_NOT_FOUND), or no sample exists yet (NO_DATA, e.g. utilisation
# right after initialisation). Such a value becomes None; every other error is not ignored.
_VALUE_UNAVAILABLE: Final = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_NO_DATA,
    }
)


class NvmlStatus(enum.StrEnum):
    """Whether GPUs could be read, and if not, why (for messages and for UI states)."""

    OK = "ok"
    """At least one GPU is visible."""
    NO_GPU = "no_gpu"
    """NVML works and sees no GPU: none attached to this container."""
    NO_LIBRARY = "no_library"
    """``libnvidia-ml.so.1`` is not installed in this container."""
    NO_DRIVER = "no_driver"
    """The library is there, the kernel driver is not loaded (or not reachable)."""
    ERROR = "error"
    """NVML failed in another way; ``Snapshot.message`` has NVML's words."""


@dataclass(frozen=True)
class GpuProcess:
    """A process using a GPU."""

    pid: int
    """As NVML reports it: the host's pid when the container has its own pid namespace."""
    name: str | None
    """``/proc/<pid>/comm``; ``None`` when that pid is not visible here."""
    used_memory: int | None
    """Bytes; ``None`` when NVML cannot say (common inside containers)."""
    sm_util: int | None = None
    """Percent of the GPU's SM time this process used lately (NVML's per-process samples of
    the last ``PROCESS_SAMPLE_SECONDS``, averaged); ``None`` when NVML has none for it."""


@dataclass(frozen=True)
class MigSlice:
    """Where a MIG device sits: its GPU and its GPU and compute instance."""

    parent_uuid: GpuUuid | None
    """The GPU the slice is part of (``None`` only if NVML would not say)."""
    profile: str | None
    """The GPU instance profile, e.g. ``1g.10gb``; ``None`` when NVML does not tell this
    process (instance queries may need privileges that a container lacks)."""
    gpu_instance_id: int
    compute_instance_id: int

    def to_json(self) -> MigSliceJson:
        return MigSliceJson(
            parent_uuid=self.parent_uuid,
            profile=self.profile,
            gpu_instance_id=self.gpu_instance_id,
            compute_instance_id=self.compute_instance_id,
        )


@dataclass(frozen=True)
class GpuState:
    """One GPU at one moment. Metrics are ``None`` when NVML does not offer them."""

    uuid: GpuUuid | None
    """``None`` only for a GPU that was lost before this monitor could read its UUID."""
    index: int
    """NVML index as seen from this container (a MIG slice has its GPU's)."""
    name: str | None
    minor: int | None
    """Driver minor: the device is ``/dev/nvidia<minor>`` (a MIG slice's GPU's)."""
    utilization_gpu: int | None
    """Percent of time a kernel was running."""
    utilization_memory: int | None
    """Percent of time memory was read or written."""
    memory_used: int | None
    """Bytes."""
    memory_total: int | None
    """Bytes."""
    temperature: int | None
    """Degrees Celsius."""
    power_draw: float | None
    """Watts."""
    power_limit: float | None
    """Watts (the enforced limit)."""
    processes: tuple[GpuProcess, ...] | None
    """Compute and graphics processes; ``None`` when NVML cannot list them."""
    simulated: bool
    lost: bool = False
    """The GPU stopped answering (``GPU_IS_LOST``); its metrics are then all ``None``."""
    mig: MigSlice | None = None
    """Set for a MIG slice; ``None`` for a whole GPU."""
    pcie_tx: int | None = None
    """Bytes/s the GPU sent over PCIe (NVML samples about 20 ms); ``None`` for a slice."""
    pcie_rx: int | None = None
    """Bytes/s the GPU received over PCIe."""
    nvlink_tx: int | None = None
    """Bytes/s sent over all NVLinks since the previous snapshot; ``None`` on a GPU without
    NVLink (NVML says NOT_SUPPORTED), and at a monitor's first reading of a GPU (a rate needs
    two of NVML's running counts)."""
    nvlink_rx: int | None = None
    """Bytes/s received over all NVLinks, as ``nvlink_tx``."""

    def metrics_json(self) -> GpuMetricsJson:
        """What the GPU is doing, without who it is: the server extension joins this to the
        agent's attachment (which says who it is) by UUID."""
        return GpuMetricsJson(
            utilization_gpu=self.utilization_gpu,
            utilization_memory=self.utilization_memory,
            memory_used=self.memory_used,
            memory_total=self.memory_total,
            temperature=self.temperature,
            power_draw=self.power_draw,
            power_limit=self.power_limit,
            pcie_tx=self.pcie_tx,
            pcie_rx=self.pcie_rx,
            nvlink_tx=self.nvlink_tx,
            nvlink_rx=self.nvlink_rx,
            processes=None
            if self.processes is None
            else [
                GpuProcessJson(pid=p.pid, name=p.name, used_memory=p.used_memory, sm_util=p.sm_util)
                for p in self.processes
            ],
            lost=self.lost,
        )

    def to_json(self) -> GpuStateJson:
        """A JSON-ready dict: the metrics and who the GPU is."""
        return GpuStateJson(
            uuid=self.uuid,
            index=self.index,
            name=self.name,
            minor=self.minor,
            **self.metrics_json(),
            simulated=self.simulated,
            mig=None if self.mig is None else self.mig.to_json(),
        )


@dataclass(frozen=True)
class Snapshot:
    """Every GPU visible to this process at ``taken_at`` (seconds since the epoch)."""

    gpus: tuple[GpuState, ...]
    status: NvmlStatus
    message: str
    """One line for people: "2 GPUs", "no GPU attached: the NVIDIA driver is not loaded"."""
    driver_version: str | None
    cuda_driver_version: str | None
    """The newest CUDA the driver supports, e.g. ``"12.4"``."""
    simulated: bool
    """Read through the simulator's fake NVML."""
    taken_at: float

    def to_json(self) -> SnapshotJson:
        """A JSON-ready dict, for diagnostics and tests (the server extension sends
        :meth:`GpuState.metrics_json` per attached GPU instead)."""
        return SnapshotJson(
            gpus=[gpu.to_json() for gpu in self.gpus],
            status=self.status.value,
            message=self.message,
            driver_version=self.driver_version,
            cuda_driver_version=self.cuda_driver_version,
            simulated=self.simulated,
            taken_at=self.taken_at,
        )


@dataclass(frozen=True)
class GpuIdentity:
    """Who one GPU is and whether it answers: what handing GPUs out needs, without metrics."""

    uuid: GpuUuid | None
    """``None`` only for a GPU that was lost before this monitor could read its UUID."""
    index: int
    name: str | None
    minor: int | None
    memory_total: int | None
    """Bytes; read each time, since that query is also what tells a lost GPU."""
    simulated: bool
    lost: bool = False
    mig: MigSlice | None = None
    """Set for a MIG slice (``roster(slices=True)``)."""
    mig_enabled: bool = False
    """A whole GPU in MIG mode: only its slices can be used, not the GPU as one."""


@dataclass(frozen=True)
class Roster:
    """Every GPU visible to this process, by identity (see ``GpuMonitor.roster``)."""

    gpus: tuple[GpuIdentity, ...]
    status: NvmlStatus
    message: str
    """As ``Snapshot.message``."""
    simulated: bool


class GpuProcessJson(TypedDict):
    pid: int
    name: str | None
    used_memory: int | None
    sm_util: int | None


class GpuMetricsJson(TypedDict):
    """What one GPU is doing now (``None``: not offered): a ``GpuState`` less who the GPU is."""

    utilization_gpu: int | None
    utilization_memory: int | None
    memory_used: int | None
    memory_total: int | None
    temperature: int | None
    power_draw: float | None
    power_limit: float | None
    pcie_tx: int | None
    pcie_rx: int | None
    nvlink_tx: int | None
    nvlink_rx: int | None
    processes: list[GpuProcessJson] | None
    lost: bool


class MigSliceJson(TypedDict):
    parent_uuid: str | None
    profile: str | None
    gpu_instance_id: int
    compute_instance_id: int


class GpuStateJson(GpuMetricsJson):
    uuid: str | None
    index: int
    name: str | None
    minor: int | None
    simulated: bool
    mig: MigSliceJson | None


class SnapshotJson(TypedDict):
    gpus: list[GpuStateJson]
    status: str
    message: str
    driver_version: str | None
    cuda_driver_version: str | None
    simulated: bool
    taken_at: float


# --- reading NVML --------------------------------------------------------------------------------


class _GpuLost(Exception):
    """One GPU answered ``GPU_IS_LOST``."""


class _NvmlBroken(Exception):
    """NVML failed in a way that is not about one value or one GPU; re-initialise."""

    def __init__(self, error: pynvml.NVMLError) -> None:
        super().__init__(str(error))
        self.error = error


def _raise_for(error: pynvml.NVMLError) -> NoReturn:
    if error.value == pynvml.NVML_ERROR_GPU_IS_LOST:
        raise _GpuLost from error
    raise _NvmlBroken(error) from error


def _value(read: Callable[..., _T], *args: Any) -> _T | None:
    """``read(*args)``; ``None`` for a value that is not available (``_VALUE_UNAVAILABLE``)."""
    try:
        return read(*args)
    except pynvml.NVMLError as error:
        if error.value in _VALUE_UNAVAILABLE:
            return None
        _raise_for(error)


def _text(value: str | bytes) -> str:
    """pynvml returns ``str`` from current versions and ``bytes`` from old ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@dataclass(frozen=True)
class _Device:
    """What does not change while NVML stays initialised: read once per enumeration."""

    index: int
    handle: Any
    """``None`` when the GPU was lost at enumeration."""
    uuid: GpuUuid | None
    name: str | None
    minor: int | None
    mig: MigSlice | None = None
    mig_enabled: bool = False


def _required(read: Callable[..., _T], *args: Any) -> _T:
    """``read(*args)`` for a value the GPU cannot be shown without (its handle, its UUID)."""
    try:
        return read(*args)
    except pynvml.NVMLError as error:
        _raise_for(error)


def _identify(index: int) -> _Device:
    """The GPU at ``index`` and what does not change about it; ``_GpuLost`` if it is lost."""
    handle = _required(pynvml.nvmlDeviceGetHandleByIndex, index)
    uuid = GpuUuid(_text(_required(pynvml.nvmlDeviceGetUUID, handle)))
    name = _value(pynvml.nvmlDeviceGetName, handle)
    minor = _value(pynvml.nvmlDeviceGetMinorNumber, handle)
    return _Device(index, handle, uuid, None if name is None else _text(name), minor)


def _found(read: Callable[..., _T], *args: Any) -> _T | None:
    """As ``_value``, and ``None`` also for ``NOT_FOUND`` (no such instance or slice here)."""
    try:
        return _value(read, *args)
    except _NvmlBroken as broken:
        if broken.error.value == pynvml.NVML_ERROR_NOT_FOUND:
            return None
        raise


def _with_slices(gpu: _Device) -> list[_Device]:
    """``gpu`` (marked when MIG is enabled on it) followed by its MIG devices that this
    process can see, in NVML's order. Walks every index up to the maximum, as NVIDIA's tools
    do: an index without a device (``NOT_FOUND``) is skipped."""
    mode = _value(pynvml.nvmlDeviceGetMigMode, gpu.handle)
    if mode is None or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
        return [gpu]
    gpu = dataclasses.replace(gpu, mig_enabled=True)
    slices = [gpu]
    for position in range(_value(pynvml.nvmlDeviceGetMaxMigDeviceCount, gpu.handle) or 0):
        handle = _found(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu.handle, position)
        if handle is None:
            continue
        gpu_instance = _required(pynvml.nvmlDeviceGetGpuInstanceId, handle)
        where = MigSlice(
            parent_uuid=gpu.uuid,
            profile=_mig_profile(gpu.handle, gpu_instance),
            gpu_instance_id=gpu_instance,
            compute_instance_id=_required(pynvml.nvmlDeviceGetComputeInstanceId, handle),
        )
        name = _value(pynvml.nvmlDeviceGetName, handle)
        uuid = GpuUuid(_text(_required(pynvml.nvmlDeviceGetUUID, handle)))
        name_text = None if name is None else _text(name)
        slices.append(_Device(gpu.index, handle, uuid, name_text, gpu.minor, where))
    return slices


def _mig_profile(gpu: Any, gpu_instance_id: int) -> str | None:
    """The profile name (``1g.10gb``) of a GPU instance: its profile id, matched among the
    GPU's instance profiles. ``None`` when NVML will not describe the instance here."""
    instance = _found(pynvml.nvmlDeviceGetGpuInstanceById, gpu, gpu_instance_id)
    info = None if instance is None else _value(pynvml.nvmlGpuInstanceGetInfo, instance)
    if info is None:
        return None
    for profile in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            described = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, profile)
        except pynvml.NVMLError as error:
            if error.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost from error
            continue  # a profile this GPU (or driver) does not offer
        if described.id == info.profileId:
            return _text(described.name).removeprefix(_MIG_PROFILE_PREFIX)
    return None


def _lost_state(device: _Device, *, simulated: bool) -> GpuState:
    return GpuState(
        mig=device.mig,
        uuid=device.uuid,
        index=device.index,
        name=device.name,
        minor=device.minor,
        utilization_gpu=None,
        utilization_memory=None,
        memory_used=None,
        memory_total=None,
        temperature=None,
        power_draw=None,
        power_limit=None,
        processes=None,
        simulated=simulated,
        lost=True,
    )


_Count = tuple[int, int]
"""An NVLink field's reading: (microseconds since the epoch, KiB so far)."""


def _count(field: Any) -> _Count | None:
    """One ``nvmlFieldValue_t``'s count, or ``None``: a GPU without NVLink answers
    NOT_SUPPORTED here, inside a successful call. Any other error of one field is about that
    value only (a driver that will not sum the links answers INVALID_ARGUMENT), so it is
    ``None`` too rather than a broken NVML; only a lost GPU is the GPU's."""
    if field.nvmlReturn == pynvml.NVML_ERROR_GPU_IS_LOST:
        raise _GpuLost
    if field.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    return field.timestamp, field.value.ullVal


def _rate(before: _Count | None, now: _Count | None) -> int | None:
    """Bytes/s between two counts; ``None`` without both, or when the count went back (the
    driver was reloaded) or no time passed."""
    if before is None or now is None or now[0] <= before[0] or now[1] < before[1]:
        return None
    return (now[1] - before[1]) * _BYTES_PER_KB * 1_000_000 // (now[0] - before[0])


def _watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else milliwatts / _MILLIWATTS_PER_WATT


def _cuda_version(encoded: int | None) -> str | None:
    """NVML encodes CUDA 12.4 as 12040 (``major * 1000 + minor * 10``)."""
    if encoded is None:
        return None
    major, rest = divmod(encoded, 1000)
    return f"{major}.{rest // 10}"


class GpuMonitor:
    """Takes ``Snapshot``s of the GPUs this process can see; safe to share between threads.

    ``dev_dir``: where the GPU device nodes appear (``/dev``; tests use a temporary directory).
    ``proc_dir``: where process names are read. ``retry_interval``: seconds between attempts
    to initialise NVML while it keeps failing and the device nodes do not change. ``clock``:
    monotonic seconds, for that interval.

    NVML calls block, briefly; async callers run ``snapshot`` in an executor. ``close`` (or
    leaving a ``with`` block) releases NVML; a later ``snapshot`` initialises it again.
    """

    def __init__(
        self,
        *,
        dev_dir: Path = Path("/dev"),
        proc_dir: Path = Path("/proc"),
        retry_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dev_dir = dev_dir
        self._proc_dir = proc_dir
        self._retry_interval = retry_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._initialised = False
        self._init_count = 0
        self._nodes: frozenset[str] | None = None
        """The GPU nodes at the last initialisation attempt."""
        self._failure: tuple[NvmlStatus, str] | None = None
        self._failed_at = 0.0
        self._devices: tuple[_Device, ...] = ()
        self._stale = True
        self._driver_version: str | None = None
        self._cuda_driver_version: str | None = None
        self._simulated = False
        self._nvlink_counts: dict[GpuUuid | None, tuple[_Count | None, _Count | None]] = {}
        """Per GPU, NVML's last NVLink counts (TX, RX): a rate is the step to the next ones."""

    @property
    def init_count(self) -> int:
        """How often NVML was initialised successfully (for diagnostics and tests)."""
        return self._init_count

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release NVML (this monitor's share of it)."""
        with self._lock:
            self._shutdown()

    def snapshot(self) -> Snapshot:
        """The GPUs now. Never raises for NVML or driver trouble: see ``status``."""
        return self._guarded(self._read, self._empty)

    def roster(self, *, slices: bool = False) -> Roster:
        """Who the GPUs are now and whether each answers, without their metrics; with
        ``slices``, each GPU in MIG mode is followed by its MIG slices.

        What is read per GPU: its memory size, the one query that also shows whether it fell
        off the bus (UUID, name and minor are read once per enumeration, as for snapshots).
        Never raises for NVML or driver trouble: see ``status``.
        """
        return self._guarded(lambda: self._read_roster(slices), self._empty_roster)

    def processes(self, minor: int) -> tuple[GpuProcess, ...] | None:
        """The processes using the GPU whose node is ``/dev/nvidia<minor>``; ``None`` when
        NVML cannot say (no such GPU, lost, NVML unavailable, or it does not list them)."""
        return self._guarded(lambda: self._read_processes(minor), lambda: None)

    def _guarded(self, read: Callable[[], _T], empty: Callable[[], _T]) -> _T:
        """``read()`` with NVML initialised for the current device nodes, or ``empty()``
        when NVML cannot be used (the reason is kept for ``status``)."""
        with self._lock:
            nodes = self._gpu_nodes()
            if self._initialised and nodes != self._nodes:
                self._shutdown()  # a GPU came or went: only a fresh NVML enumerates it
            if not self._initialised and not self._initialise(nodes):
                return empty()
            try:
                return read()
            except _NvmlBroken as broken:
                self._shutdown()
                self._fail(NvmlStatus.ERROR, f"cannot read the GPUs: NVML failed: {broken}")
                self._failed_at = float("-inf")  # re-initialise on the next read
                return empty()

    # --- initialisation ------------------------------------------------------------------------

    def _gpu_nodes(self) -> frozenset[str]:
        """The GPU nodes and the MIG access nodes (``nvidia-caps/nvidia-cap<N>``) now."""
        return frozenset(_list(self._dev_dir, _GPU_NODE)) | frozenset(
            f"{_CAPS_DIR}/{name}" for name in _list(self._dev_dir / _CAPS_DIR, _CAPS_NODE)
        )

    def _initialise(self, nodes: frozenset[str]) -> bool:
        retry_due = self._clock() - self._failed_at >= self._retry_interval
        if self._failure is not None and nodes == self._nodes and not retry_due:
            return False
        self._nodes = nodes
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            self._fail(*_init_failure(error))
            return False
        self._initialised = True
        self._init_count += 1
        self._failure = None
        self._stale = True
        self._devices = ()
        self._simulated = is_fake_library(pynvml.nvmlLib)
        try:
            version = _value(pynvml.nvmlSystemGetDriverVersion)
            cuda = _value(pynvml.nvmlSystemGetCudaDriverVersion)
        except (_NvmlBroken, _GpuLost):
            # Versions are decoration; the GPUs themselves are read (and judged) next.
            version = cuda = None
        self._driver_version = None if version is None else _text(version)
        self._cuda_driver_version = _cuda_version(cuda)
        return True

    def _fail(self, status: NvmlStatus, message: str) -> None:
        self._failure = (status, message)
        self._failed_at = self._clock()

    def _shutdown(self) -> None:
        if not self._initialised:
            return
        self._initialised = False
        self._devices = ()
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            # Only fails when NVML is no longer initialised (someone else shut it down too
            # often); there is nothing left to release then.
            return

    def _empty(self) -> Snapshot:
        status, message = self._failure or (NvmlStatus.ERROR, "cannot read the GPUs")
        return Snapshot(
            gpus=(),
            status=status,
            message=message,
            driver_version=None,
            cuda_driver_version=None,
            simulated=False,
            taken_at=time.time(),
        )

    def _empty_roster(self) -> Roster:
        status, message = self._failure or (NvmlStatus.ERROR, "cannot read the GPUs")
        return Roster(gpus=(), status=status, message=message, simulated=False)

    # --- reading -------------------------------------------------------------------------------

    def _devices_now(self) -> tuple[_Device, ...]:
        """The enumerated GPUs (each followed by its MIG slices), enumerated again when NVML's
        count changed or one was lost."""
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as error:
            raise _NvmlBroken(error) from error
        if self._stale or count != sum(device.mig is None for device in self._devices):
            self._enumerate(count)
        return self._devices

    def _read(self) -> Snapshot:
        devices = self._devices_now()
        names: dict[int, str | None] = {}  # one /proc read per pid and snapshot
        gpus = tuple(self._state(device, names) for device in devices)
        status, message = _summary(
            sum(gpu.mig is None for gpu in gpus),
            lost=sum(gpu.lost for gpu in gpus if gpu.mig is None),
            slices=sum(gpu.mig is not None for gpu in gpus),
        )
        return Snapshot(
            gpus=gpus,
            status=status,
            message=message,
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_driver_version,
            simulated=self._simulated,
            taken_at=time.time(),
        )

    def _enumerate(self, count: int) -> None:
        known = {device.index: device for device in self._devices if device.mig is None}
        devices: list[_Device] = []
        for index in range(count):
            try:
                gpu = _identify(index)
                devices += _with_slices(gpu)
            except _GpuLost:
                # Keep what was known of the GPU at this index, so a lost GPU keeps its name.
                previous = known.get(index)
                if previous is None:
                    devices.append(_Device(index, None, None, None, None))
                else:
                    devices.append(
                        _Device(index, None, previous.uuid, previous.name, previous.minor)
                    )
        self._devices = tuple(devices)
        self._stale = False

    def _read_roster(self, slices: bool) -> Roster:
        gpus = tuple(
            self._identity(device) for device in self._devices_now() if slices or device.mig is None
        )
        status, message = _summary(
            sum(gpu.mig is None for gpu in gpus),
            lost=sum(gpu.lost for gpu in gpus if gpu.mig is None),
            slices=sum(gpu.mig is not None for gpu in gpus),
        )
        return Roster(gpus=gpus, status=status, message=message, simulated=self._simulated)

    def _identity(self, device: _Device) -> GpuIdentity:
        memory = None
        lost = device.handle is None
        if not lost:
            try:
                memory = _value(pynvml.nvmlDeviceGetMemoryInfo, device.handle)
            except _GpuLost:
                lost = True
        if lost:
            self._stale = True  # look again: it may be back, or another GPU in its place
        return GpuIdentity(
            uuid=device.uuid,
            index=device.index,
            name=device.name,
            minor=device.minor,
            memory_total=None if memory is None else memory.total,
            simulated=self._is_simulated(device),
            lost=lost,
            mig=device.mig,
            mig_enabled=device.mig_enabled,
        )

    def _read_processes(self, minor: int) -> tuple[GpuProcess, ...] | None:
        for device in self._devices_now():
            if device.minor != minor or device.handle is None or device.mig is not None:
                continue
            try:
                return self._processes(device.handle, {})
            except _GpuLost:
                self._stale = True
                return None
        return None

    def _is_simulated(self, device: _Device) -> bool:
        return self._simulated or (device.name or "").endswith(SIMULATED_SUFFIX)

    def _state(self, device: _Device, names: dict[int, str | None]) -> GpuState:
        simulated = self._is_simulated(device)
        if device.handle is None:
            self._stale = True  # look again: it may be back, or another GPU in its place
            return _lost_state(device, simulated=simulated)
        handle = device.handle
        try:
            memory = _value(pynvml.nvmlDeviceGetMemoryInfo, handle)
            utilization = _value(pynvml.nvmlDeviceGetUtilizationRates, handle)
            temperature = _value(
                pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
            )
            power_draw = _value(pynvml.nvmlDeviceGetPowerUsage, handle)
            power_limit = _value(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            processes = self._processes(handle, names)
            pcie_tx, pcie_rx, nvlink_tx, nvlink_rx = (
                (None,) * 4 if device.mig is not None else self._traffic(device)
            )
        except _GpuLost:
            self._stale = True
            return _lost_state(device, simulated=simulated)
        return GpuState(
            uuid=device.uuid,
            index=device.index,
            name=device.name,
            minor=device.minor,
            utilization_gpu=None if utilization is None else utilization.gpu,
            utilization_memory=None if utilization is None else utilization.memory,
            memory_used=None if memory is None else memory.used,
            memory_total=None if memory is None else memory.total,
            temperature=temperature,
            power_draw=_watts(power_draw),
            power_limit=_watts(power_limit),
            processes=processes,
            simulated=simulated,
            mig=device.mig,
            pcie_tx=pcie_tx,
            pcie_rx=pcie_rx,
            nvlink_tx=nvlink_tx,
            nvlink_rx=nvlink_rx,
        )

    def _traffic(self, device: _Device) -> tuple[int | None, int | None, int | None, int | None]:
        """Bytes/s over PCIe (TX, RX) and over all NVLinks (TX, RX) of a whole GPU.

        PCIe is NVML's own rate. NVLink is read as NVML's running counts of KiB with their
        timestamps (``nvmlDeviceGetFieldValues``: one call for both directions, where the
        older per-link utilisation counters are deprecated and absent on current GPUs); the
        rate is the step from this monitor's previous counts of the GPU.
        """
        handle = device.handle
        pcie_tx = _value(pynvml.nvmlDeviceGetPcieThroughput, handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        pcie_rx = _value(pynvml.nvmlDeviceGetPcieThroughput, handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        fields = _value(pynvml.nvmlDeviceGetFieldValues, handle, _NVLINK_FIELDS)
        counts = (None, None) if fields is None else (_count(fields[0]), _count(fields[1]))
        before = self._nvlink_counts.get(device.uuid, (None, None))
        self._nvlink_counts[device.uuid] = counts
        return (
            None if pcie_tx is None else pcie_tx * _BYTES_PER_KB,
            None if pcie_rx is None else pcie_rx * _BYTES_PER_KB,
            _rate(before[0], counts[0]),
            _rate(before[1], counts[1]),
        )

    def _processes(
        self, handle: Any, names: dict[int, str | None]
    ) -> tuple[GpuProcess, ...] | None:
        compute = _value(pynvml.nvmlDeviceGetComputeRunningProcesses, handle)
        graphics = _value(pynvml.nvmlDeviceGetGraphicsRunningProcesses, handle)
        if compute is None and graphics is None:
            return None
        utilization = _process_utilization(handle) if compute or graphics else {}
        found: dict[int, GpuProcess] = {}
        for info in [*(compute or ()), *(graphics or ())]:
            if info.pid in found:
                continue
            if info.pid not in names:
                names[info.pid] = self._process_name(info.pid)
            found[info.pid] = GpuProcess(
                pid=info.pid,
                name=names[info.pid],
                used_memory=info.usedGpuMemory,
                sm_util=utilization.get(info.pid),
            )
        return tuple(found.values())

    def _process_name(self, pid: int) -> str | None:
        try:
            with open(os.path.join(self._proc_dir, str(pid), "comm"), "rb") as comm:
                return comm.read().decode(errors="replace").strip()
        except OSError:
            # The pid belongs to another pid namespace (NVML reports host pids) or has exited.
            return None


def _process_utilization(handle: Any) -> dict[int, int]:
    """Each process's SM utilisation over the last ``PROCESS_SAMPLE_SECONDS`` (the mean of
    NVML's samples, by pid); empty when NVML has no samples (``NOT_FOUND``) or does not offer
    them (MIG devices, old drivers, containers without the permission)."""
    since = int((time.time() - PROCESS_SAMPLE_SECONDS) * _MICROSECONDS)
    samples = _found(pynvml.nvmlDeviceGetProcessUtilization, handle, since) or ()
    by_pid: dict[int, list[int]] = {}
    for sample in samples:
        by_pid.setdefault(sample.pid, []).append(sample.smUtil)
    return {pid: round(sum(values) / len(values)) for pid, values in by_pid.items()}


def _summary(count: int, *, lost: int, slices: int = 0) -> tuple[NvmlStatus, str]:
    """Status and message of a read that found ``count`` GPUs, ``lost`` of them lost, and
    ``slices`` MIG slices of them."""
    if not count:
        return NvmlStatus.NO_GPU, "no GPU attached"
    message = f"{count} GPU{'' if count == 1 else 's'}"
    if slices:
        message += f", {slices} MIG slice{'' if slices == 1 else 's'}"
    return NvmlStatus.OK, message + (f" ({lost} lost)" if lost else "")


def _list(directory: Path, pattern: re.Pattern[str]) -> list[str]:
    """The names in ``directory`` that match ``pattern``; none when it cannot be listed."""
    try:
        names = os.listdir(directory)
    except OSError:
        # No such directory (or not readable): no node can be there.
        return []
    return [name for name in names if pattern.fullmatch(name)]


def _init_failure(error: pynvml.NVMLError) -> tuple[NvmlStatus, str]:
    if error.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return (
            NvmlStatus.NO_LIBRARY,
            "no GPU attached: the NVIDIA management library (libnvidia-ml.so.1) is not "
            "installed in this container",
        )
    if error.value == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return NvmlStatus.NO_DRIVER, "no GPU attached: the NVIDIA driver is not loaded"
    return NvmlStatus.ERROR, f"cannot read the GPUs: NVML did not start: {error}"
