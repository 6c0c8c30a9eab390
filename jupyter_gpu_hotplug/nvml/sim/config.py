"""The simulated GPUs as typed values, and the config file the fake NVML library reads.

Boundary: pure values, the text format (``render_config``/``parse_config``) and an atomic file
write and read. Nothing here loads NVML or runs a compiler.

Why it exists: the agent's ``--simulate N`` mode, local demos and the tests all describe fake
GPUs, and ``fakenvml.c`` must see exactly what they meant. So there is one model, validated
with the same rules as the C parser, rendered to one versioned format, and written by atomic
rename, which the library detects without a restart (it keeps the loaded file open, so a
replacement always has a new inode number).

Format version 1 (the C header comment of ``fakenvml.c`` is the reference)::

    # comments and blank lines are ignored
    version=1
    driver_version=550.54.15
    cuda_driver_version=12040

    [gpu]
    uuid=GPU-5c7b2f0e-...
    minor=0
    name=NVIDIA H100 80GB HBM3 (simulated)
    pci_bus_id=00000000:18:00.0
    pci_device_id=0x233010DE
    memory_total=85520809984
    memory_used=0
    utilization_gpu=0
    utilization_memory=0
    temperature=31
    power_usage=69000
    power_limit=700000
    compute_capability=9.0
    processes=4242:1073741824:55,4243:na
    lost=0
    mig=enabled
    pcie_tx=125000
    pcie_rx=2400000
    nvlinks=18
    nvlink_tx=0
    nvlink_rx=0

    [mig]
    uuid=MIG-0b4c9a5e-...
    profile=1g.10gb
    gpu_instance_id=1
    compute_instance_id=0
    placement_start=0
    gi_access_minor=12
    ci_access_minor=13
    name=NVIDIA H100 80GB HBM3 MIG 1g.10gb (simulated)
    memory_total=10000000000
    memory_used=0
    processes=

Every ``[gpu]`` section needs ``uuid`` and ``minor``; other keys default as in
``SimulatedGpu``. A process's memory of ``na`` means NVML reports it as not available; a
third field (``pid:bytes:55``) is its SM utilisation in percent, the one sample
``nvmlDeviceGetProcessUtilization`` answers for it (a GPU's processes only: NVML has no
per-process samples on a MIG device).
A ``[mig]`` section is a MIG device (one GPU instance with one compute instance) of the
``[gpu]`` above it, which needs ``mig=enabled``; it needs ``uuid``, ``profile``,
``gpu_instance_id`` and the two ``nvidia-caps`` minors, other keys default as in
``SimulatedMigDevice``. MIG sections came after version 1 was first written; they were added
to it compatibly (an older reader rejects them loudly as an unknown section).
``pcie_tx``/``pcie_rx`` are KB/s, as ``nvmlDeviceGetPcieThroughput`` reports them;
``nvlinks`` is how many NVLinks the GPU has (0: none, its NVLink fields are not supported) and
``nvlink_tx``/``nvlink_rx`` the KiB/s over all of them, which the library turns into NVML's
running counts. These keys, too, were added to version 1 compatibly (all default to 0).
Unknown or repeated keys are errors, so a typo cannot pass silently.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Final

from ..._structs import GpuUuid
from .errors import FakeNvmlConfigError

__all__ = [
    "DEFAULT_CUDA_DRIVER_VERSION",
    "DEFAULT_DRIVER_VERSION",
    "FORMAT_VERSION",
    "H100_SXM",
    "MAX_GPUS",
    "MAX_GPU_MINOR",
    "MAX_MIG_DEVICES",
    "MAX_NVLINKS",
    "MAX_PROCESSES",
    "SIMULATED_SUFFIX",
    "FakeNvmlConfig",
    "GpuModel",
    "GpuUuid",
    "MigMode",
    "SimulatedGpu",
    "SimulatedMigDevice",
    "SimulatedProcess",
    "default_gpus",
    "mig_caps_minors",
    "parse_config",
    "read_config",
    "render_config",
    "render_mig_minors",
    "with_mig_devices",
    "with_nvlinks",
    "write_config",
]

FORMAT_VERSION: Final = 1
"""The config format this module writes; ``fakeNvmlConfigFormat()`` in the library must match."""

DEFAULT_DRIVER_VERSION: Final = "550.54.15"
DEFAULT_CUDA_DRIVER_VERSION: Final = 12040
"""CUDA 12.4, encoded as NVML does: ``major * 1000 + minor * 10``."""

MAX_GPUS: Final = 64
MAX_PROCESSES: Final = 64
MAX_GPU_MINOR: Final = 254
"""Highest GPU minor: 255 is ``/dev/nvidiactl``."""

MAX_MIG_DEVICES: Final = 7
"""MIG devices per GPU: what ``nvmlDeviceGetMaxMigDeviceCount`` reports for an A100 or H100
in MIG mode (seven 1g slices)."""
MAX_NVLINKS: Final = 36
"""NVLinks per GPU at most (``NVML_NVLINK_MAX_LINKS``); an H100 SXM has 18."""
MIG_SLICE_COUNTS: Final = (1, 2, 3, 4, 7)
"""Compute slices of the GPU instance profiles the simulator offers (``<n>g.<m>gb``)."""

SIMULATED_SUFFIX: Final = " (simulated)"
"""Appended to every generated GPU name, so no screen can pass a fake GPU off as real."""

_MAX_TEXT_BYTES: Final = 95  # NVML_DEVICE_{UUID,NAME}_V2_BUFFER_SIZE minus the NUL
_MAX_VERSION_BYTES: Final = 79  # NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE minus the NUL
_UINT_MAX: Final = 2**32 - 1
_ULLONG_MAX: Final = 2**64 - 1
_INT_MAX: Final = 2**31 - 1
_WHITESPACE: Final = " \t\n\r\v\f"  # what C's isspace() trims
_NOT_AVAILABLE: Final = "na"  # a process's memory that NVML reports as not available
_BUS_ID = re.compile(
    r"(?:(?P<domain>[0-9A-Fa-f]{1,8}):)?(?P<bus>[0-9A-Fa-f]{1,8}):"
    r"(?P<device>[0-9A-Fa-f]{1,8})\.(?P<function>[0-9A-Fa-f]{1,8})"
)
_DECIMAL = re.compile(r"[0-9]+")
_HEX = re.compile(r"0[xX](?P<digits>[0-9A-Fa-f]+)")
_MIG_PROFILE = re.compile(r"(?P<slices>[1-9])g\.(?P<gigabytes>[1-9][0-9]{0,3})gb")
_MAX_GPU_INSTANCE_ID: Final = 14
_MAX_COMPUTE_INSTANCE_ID: Final = 7
_MAX_CAPS_MINOR: Final = 2**20 - 1  # MINORMASK: the widest minor Linux has


def _check_int(name: str, value: int, maximum: int, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FakeNvmlConfigError(f"{name} must be an int, not {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise FakeNvmlConfigError(f"{name}={value} is outside {minimum}..{maximum}")


def _check_text(name: str, value: str, max_bytes: int) -> None:
    if not isinstance(value, str):
        raise FakeNvmlConfigError(f"{name} must be a str, not {type(value).__name__}")
    if not value or value != value.strip(_WHITESPACE) or "\n" in value or "\r" in value:
        raise FakeNvmlConfigError(
            f"{name}={value!r} must be non-empty, one line, without surrounding whitespace"
        )
    if len(value.encode()) > max_bytes:
        raise FakeNvmlConfigError(f"{name}={value!r} is longer than {max_bytes} bytes")


def _canonical_bus_id(text: str) -> str:
    """NVML's spelling (``%08X:%02X:%02X.%X``) of a PCI address, or an error."""
    match = _BUS_ID.fullmatch(text)
    if match is None:
        raise FakeNvmlConfigError(f"pci_bus_id {text!r}: expected DOMAIN:BUS:DEVICE.FUNCTION (hex)")
    domain = int(match["domain"] or "0", 16)
    bus, device, function = (int(match[part], 16) for part in ("bus", "device", "function"))
    if bus > 0xFF or device > 0x1F or function > 0x7:
        raise FakeNvmlConfigError(f"pci_bus_id {text!r}: bus, device or function out of range")
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function:X}"


@dataclass(frozen=True)
class SimulatedProcess:
    """A process that NVML lists as running on a GPU (a compute process)."""

    pid: int
    used_memory: int | None
    """Bytes of GPU memory the process holds; ``None``: NVML reports it as not available (its
    2**64 - 1 sentinel, which pynvml turns into ``None``), as it does in many containers."""
    sm_util: int | None = None
    """Percent of the GPU's SM time this process used (its sample in
    ``nvmlDeviceGetProcessUtilization``); ``None``: no sample."""

    def __post_init__(self) -> None:
        _check_int("pid", self.pid, _UINT_MAX, minimum=1)
        if self.used_memory is not None:
            _check_int("used_memory", self.used_memory, _ULLONG_MAX - 1)
        if self.sm_util is not None:
            _check_int("sm_util", self.sm_util, 100)


class MigMode(enum.StrEnum):
    """What ``nvmlDeviceGetMigMode`` answers for a GPU."""

    UNSUPPORTED = "unsupported"
    """Not a MIG-capable GPU: ``NVML_ERROR_NOT_SUPPORTED``."""
    DISABLED = "disabled"
    ENABLED = "enabled"


def mig_caps_minors(
    gpu_minor: int, gpu_instance_id: int, compute_instance_id: int
) -> tuple[int, int]:
    """The ``nvidia-caps`` minors of a GPU instance's and a compute instance's ``access`` file,
    laid out as the driver numbers them in ``/proc/driver/nvidia-caps/mig-minors``.

    ``config`` is 1 and ``monitor`` 2; then, per GPU minor, 15 GPU instances of nine minors
    each: the GI's ``access`` and its eight compute instances'. So ``gpu0/gi0/access`` is 3 and
    ``gpu0/gi0/ci0/access`` is 4, as NVIDIA's container toolkit tests show. Only the simulator
    uses this: the product always reads the file.
    """
    _check_int("gpu minor", gpu_minor, MAX_GPU_MINOR)
    _check_int("gpu_instance_id", gpu_instance_id, _MAX_GPU_INSTANCE_ID)
    _check_int("compute_instance_id", compute_instance_id, _MAX_COMPUTE_INSTANCE_ID)
    stride = _MAX_COMPUTE_INSTANCE_ID + 2
    gi_minor = 3 + stride * ((_MAX_GPU_INSTANCE_ID + 1) * gpu_minor + gpu_instance_id)
    return gi_minor, gi_minor + 1 + compute_instance_id


@dataclass(frozen=True)
class SimulatedMigDevice:
    """One MIG device: a GPU instance with one compute instance spanning it (the layout
    ``nvidia-smi mig -cgi <profile> -C`` makes), field for field what ``pynvml`` reports.

    Several compute instances in one GPU instance are not simulated.
    """

    uuid: GpuUuid
    """``MIG-<uuid>``, as NVML writes MIG UUIDs since R470."""
    profile: str
    """The GPU instance profile, ``<slices>g.<memory>gb`` (e.g. ``1g.10gb``)."""
    gpu_instance_id: int
    gi_access_minor: int
    """Minor of ``/dev/nvidia-caps/nvidia-cap<N>`` for ``gpu<G>/gi<I>/access``."""
    ci_access_minor: int
    """Minor of ``/dev/nvidia-caps/nvidia-cap<N>`` for ``gpu<G>/gi<I>/ci<C>/access``."""
    compute_instance_id: int = 0
    placement_start: int = 0
    """First memory slice of the GPU instance (``nvmlGpuInstanceGetInfo``)."""
    name: str = ""
    """Empty: ``NVIDIA MIG <profile> (simulated)``."""
    memory_total: int = 0
    """Bytes."""
    memory_used: int = 0
    """Bytes, at most ``memory_total``."""
    processes: tuple[SimulatedProcess, ...] = ()

    def __post_init__(self) -> None:
        _check_text("uuid", self.uuid, _MAX_TEXT_BYTES)
        if not self.uuid.startswith("MIG-"):
            raise FakeNvmlConfigError(f"MIG uuid {self.uuid!r} must start with MIG-")
        _check_text("profile", self.profile, _MAX_TEXT_BYTES)
        if _MIG_PROFILE.fullmatch(self.profile) is None or self.slices not in MIG_SLICE_COUNTS:
            raise FakeNvmlConfigError(
                f"profile {self.profile!r}: expected <slices>g.<memory>gb with slices one of "
                f"{', '.join(map(str, MIG_SLICE_COUNTS))}"
            )
        _check_int("gpu_instance_id", self.gpu_instance_id, _MAX_GPU_INSTANCE_ID)
        _check_int("compute_instance_id", self.compute_instance_id, _MAX_COMPUTE_INSTANCE_ID)
        _check_int("placement_start", self.placement_start, 7)
        for key in ("gi_access_minor", "ci_access_minor"):
            _check_int(key, getattr(self, key), _MAX_CAPS_MINOR)
        if self.gi_access_minor == self.ci_access_minor:
            raise FakeNvmlConfigError(f"MIG {self.uuid}: the GI and CI access minors are equal")
        _check_int("memory_total", self.memory_total, _ULLONG_MAX)
        _check_int("memory_used", self.memory_used, self.memory_total)
        if len(self.processes) > MAX_PROCESSES:
            raise FakeNvmlConfigError(f"MIG {self.uuid}: more than {MAX_PROCESSES} processes")
        if any(process.sm_util is not None for process in self.processes):
            raise FakeNvmlConfigError(f"MIG {self.uuid}: a MIG device's process has no sm_util")
        object.__setattr__(self, "processes", tuple(self.processes))
        if not self.name:
            object.__setattr__(self, "name", f"NVIDIA MIG {self.profile}{SIMULATED_SUFFIX}")
        _check_text("name", self.name, _MAX_TEXT_BYTES)

    @property
    def slices(self) -> int:
        """Compute slices of the GPU instance (the ``1`` of ``1g.10gb``)."""
        return int(self.profile.partition("g")[0])


@dataclass(frozen=True)
class SimulatedGpu:
    """One fake GPU, field for field what ``pynvml`` will report for it.

    Defaults equal the C parser's defaults for a missing key, so a hand-written file and this
    model agree. ``pci_bus_id`` is normalised to NVML's spelling; left empty it becomes
    ``00000000:<minor + 1>:00.0``.
    """

    uuid: GpuUuid
    minor: int
    """The driver minor: the GPU's node is ``/dev/nvidia<minor>`` (not the NVML index)."""
    name: str = "NVIDIA GPU" + SIMULATED_SUFFIX
    pci_bus_id: str = ""
    pci_device_id: int = 0x233010DE
    """PCI device id << 16 | vendor id, as NVML reports ``pciDeviceId``."""
    memory_total: int = 0
    """Bytes."""
    memory_used: int = 0
    """Bytes, at most ``memory_total``."""
    utilization_gpu: int = 0
    """Percent of time a kernel was running, 0..100."""
    utilization_memory: int = 0
    """Percent of time memory was read or written, 0..100."""
    temperature: int = 30
    """Degrees Celsius."""
    power_usage: int = 0
    """Milliwatts, as ``nvmlDeviceGetPowerUsage`` reports."""
    power_limit: int = 0
    """Milliwatts; the enforced, management and default limits all report it."""
    compute_capability: tuple[int, int] = (9, 0)
    processes: tuple[SimulatedProcess, ...] = ()
    lost: bool = False
    """The GPU "fell off the bus": NVML answers ``NVML_ERROR_GPU_IS_LOST`` for it."""
    mig: MigMode = MigMode.UNSUPPORTED
    mig_devices: tuple[SimulatedMigDevice, ...] = ()
    """In MIG device index order; only with ``mig=ENABLED``."""
    pcie_tx: int = 0
    """KB/s sent over PCIe, as ``nvmlDeviceGetPcieThroughput`` reports."""
    pcie_rx: int = 0
    """KB/s received over PCIe."""
    nvlinks: int = 0
    """NVLinks of the GPU; 0: none, and NVML answers NOT_SUPPORTED for its NVLink fields."""
    nvlink_tx: int = 0
    """KiB/s sent over all NVLinks together; more than 0 needs ``nvlinks``."""
    nvlink_rx: int = 0
    """KiB/s received over all NVLinks together."""

    def __post_init__(self) -> None:
        _check_text("uuid", self.uuid, _MAX_TEXT_BYTES)
        _check_text("name", self.name, _MAX_TEXT_BYTES)
        _check_int("minor", self.minor, MAX_GPU_MINOR)
        _check_int("pci_device_id", self.pci_device_id, _UINT_MAX)
        _check_int("memory_total", self.memory_total, _ULLONG_MAX)
        _check_int("memory_used", self.memory_used, self.memory_total)
        _check_int("utilization_gpu", self.utilization_gpu, 100)
        _check_int("utilization_memory", self.utilization_memory, 100)
        _check_int("temperature", self.temperature, 200)
        _check_int("power_usage", self.power_usage, _UINT_MAX)
        _check_int("power_limit", self.power_limit, _UINT_MAX)
        if len(self.compute_capability) != 2:
            raise FakeNvmlConfigError("compute_capability must be (major, minor)")
        for part in self.compute_capability:
            _check_int("compute_capability", part, 99)
        if not isinstance(self.lost, bool):
            raise FakeNvmlConfigError("lost must be a bool")
        _check_int("pcie_tx", self.pcie_tx, _UINT_MAX)
        _check_int("pcie_rx", self.pcie_rx, _UINT_MAX)
        _check_int("nvlinks", self.nvlinks, MAX_NVLINKS)
        _check_int("nvlink_tx", self.nvlink_tx, _ULLONG_MAX)
        _check_int("nvlink_rx", self.nvlink_rx, _ULLONG_MAX)
        if not self.nvlinks and (self.nvlink_tx or self.nvlink_rx):
            raise FakeNvmlConfigError(f"GPU {self.uuid} has NVLink traffic but nvlinks=0")
        if len(self.processes) > MAX_PROCESSES:
            raise FakeNvmlConfigError(f"GPU {self.uuid}: more than {MAX_PROCESSES} processes")
        object.__setattr__(self, "mig", MigMode(self.mig))
        self._check_mig()
        bus_id = self.pci_bus_id or f"00000000:{self.minor + 1:02X}:00.0"
        # Normalising a frozen field: the one place a frozen dataclass writes itself.
        object.__setattr__(self, "pci_bus_id", _canonical_bus_id(bus_id))
        object.__setattr__(self, "processes", tuple(self.processes))
        object.__setattr__(self, "compute_capability", tuple(self.compute_capability))

    def _check_mig(self) -> None:
        devices = tuple(self.mig_devices)
        object.__setattr__(self, "mig_devices", devices)
        if devices and self.mig is not MigMode.ENABLED:
            raise FakeNvmlConfigError(f"GPU {self.uuid} has MIG devices but mig={self.mig}")
        if len(devices) > MAX_MIG_DEVICES:
            raise FakeNvmlConfigError(f"GPU {self.uuid}: more than {MAX_MIG_DEVICES} MIG devices")
        ids = [device.gpu_instance_id for device in devices]
        if len(set(ids)) != len(ids):
            raise FakeNvmlConfigError(f"GPU {self.uuid}: a gpu_instance_id appears twice")
        if sum(device.slices for device in devices) > MAX_MIG_DEVICES:
            raise FakeNvmlConfigError(f"GPU {self.uuid}: MIG devices use more than 7 slices")
        if sum(device.memory_total for device in devices) > self.memory_total:
            raise FakeNvmlConfigError(f"GPU {self.uuid}: MIG devices hold more than its memory")
        profiles: dict[int, str] = {}
        for device in devices:
            if profiles.setdefault(device.slices, device.profile) != device.profile:
                raise FakeNvmlConfigError(
                    f"GPU {self.uuid}: profiles {profiles[device.slices]} and {device.profile} "
                    "have the same slice count (one profile per slice count is simulated)"
                )


@dataclass(frozen=True)
class FakeNvmlConfig:
    """A whole simulated node: the driver and its GPUs, in NVML index order."""

    gpus: tuple[SimulatedGpu, ...] = ()
    driver_version: str = DEFAULT_DRIVER_VERSION
    cuda_driver_version: int = DEFAULT_CUDA_DRIVER_VERSION
    """``major * 1000 + minor * 10``, as ``nvmlSystemGetCudaDriverVersion`` reports."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", tuple(self.gpus))
        _check_text("driver_version", self.driver_version, _MAX_VERSION_BYTES)
        _check_int("cuda_driver_version", self.cuda_driver_version, _INT_MAX)
        if len(self.gpus) > MAX_GPUS:
            raise FakeNvmlConfigError(f"more than {MAX_GPUS} GPUs")
        devices = [device for gpu in self.gpus for device in gpu.mig_devices]
        unique: dict[str, list[str]] = {
            "uuid": [str(g.uuid) for g in self.gpus] + [str(d.uuid) for d in devices],
            "minor": [str(gpu.minor) for gpu in self.gpus],
            "nvidia-caps minor": [
                str(minor) for d in devices for minor in (d.gi_access_minor, d.ci_access_minor)
            ],
        }
        for what, values in unique.items():
            duplicates = sorted({v for v in values if values.count(v) > 1})
            if duplicates:
                raise FakeNvmlConfigError(f"{what} appears twice: {', '.join(duplicates)}")

    def gpu(self, uuid: GpuUuid | str) -> SimulatedGpu:
        """The GPU with this UUID; ``KeyError`` if there is none."""
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise KeyError(uuid)


@dataclass(frozen=True)
class GpuModel:
    """What a kind of GPU looks like to NVML when idle; ``default_gpus`` stamps copies of it."""

    name: str
    memory_total: int
    power_limit: int
    """Milliwatts."""
    idle_power: int
    """Milliwatts."""
    idle_temperature: int
    pci_device_id: int
    compute_capability: tuple[int, int]


H100_SXM: Final = GpuModel(
    name="NVIDIA H100 80GB HBM3",
    memory_total=81559 * 2**20,  # what nvidia-smi reports as 81559MiB
    power_limit=700_000,
    idle_power=69_000,
    idle_temperature=31,
    pci_device_id=0x233010DE,
    compute_capability=(9, 0),
)

# Fixed namespace for deterministic GPU UUIDs: the same (node, index) always gets the same UUID.
_UUID_NAMESPACE: Final = uuid.UUID("6b1e1f3c-3d1a-4c55-9a55-0f5b7e0c2d41")
# The buses of the eight GPUs of an HGX H100 board, so a simulated node looks like a real one.
_HGX_BUSES: Final = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


def _hgx_bus_id(index: int) -> str:
    domain, slot = divmod(index, len(_HGX_BUSES))
    return f"{domain:08X}:{_HGX_BUSES[slot]:02X}:00.0"


def default_gpus(
    count: int, *, model: GpuModel = H100_SXM, node: str = "simulated-node"
) -> tuple[SimulatedGpu, ...]:
    """``count`` idle GPUs of ``model`` with stable identities.

    UUIDs derive from ``node`` and the index, so they survive restarts and differ between
    simulated nodes; minors are ``0..count-1``; PCI addresses follow an HGX board, eight GPUs
    per PCI domain. Names carry ``SIMULATED_SUFFIX``.
    """
    _check_int("count", count, MAX_GPUS)
    return tuple(
        SimulatedGpu(
            uuid=GpuUuid(f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{index}')}"),
            minor=index,
            name=model.name + SIMULATED_SUFFIX,
            pci_bus_id=_hgx_bus_id(index),
            pci_device_id=model.pci_device_id,
            memory_total=model.memory_total,
            temperature=model.idle_temperature,
            power_usage=model.idle_power,
            power_limit=model.power_limit,
            compute_capability=model.compute_capability,
        )
        for index in range(count)
    )


def with_mig_devices(
    gpu: SimulatedGpu, profiles: Sequence[str], *, node: str = "simulated-node"
) -> SimulatedGpu:
    """``gpu`` in MIG mode with one MIG device per profile (e.g. ``("1g.10gb", "1g.10gb")``).

    GPU instance ids count from 1 and placements follow each other, as ``nvidia-smi mig -cgi
    ... -C`` leaves them on an empty GPU; each device gets the memory its profile names (in
    decimal gigabytes, so that seven slices fit an 80 GB GPU), a stable ``MIG-`` UUID derived
    from ``node``, the GPU's UUID and the instance id, the ``nvidia-caps`` minors the driver
    would give it (``mig_caps_minors``) and a name labelled as simulated.
    """
    devices = []
    placement = 0
    model = gpu.name.removesuffix(SIMULATED_SUFFIX)
    for gpu_instance_id, profile in enumerate(profiles, start=1):
        match = _MIG_PROFILE.fullmatch(profile)
        if match is None:
            raise FakeNvmlConfigError(f"profile {profile!r}: expected <slices>g.<memory>gb")
        gi_minor, ci_minor = mig_caps_minors(gpu.minor, gpu_instance_id, 0)
        devices.append(
            SimulatedMigDevice(
                uuid=GpuUuid(
                    f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{gpu.uuid}/{gpu_instance_id}')}"
                ),
                profile=profile,
                gpu_instance_id=gpu_instance_id,
                gi_access_minor=gi_minor,
                ci_access_minor=ci_minor,
                placement_start=min(placement, 7),
                name=f"{model} MIG {profile}{SIMULATED_SUFFIX}",
                memory_total=int(match["gigabytes"]) * 10**9,
            )
        )
        placement += int(match["slices"])
    return dataclasses.replace(gpu, mig=MigMode.ENABLED, mig_devices=tuple(devices))


def with_nvlinks(gpu: SimulatedGpu, links: int = 18) -> SimulatedGpu:
    """``gpu`` with ``links`` NVLinks (an H100 SXM's 18 by default), idle."""
    return dataclasses.replace(gpu, nvlinks=links)


def render_mig_minors(config: FakeNvmlConfig) -> str:
    """``/proc/driver/nvidia-caps/mig-minors`` for a simulated node: ``config``, ``monitor`` and
    every GPU and compute instance access file that MIG-capable GPUs can have, numbered as
    ``mig_caps_minors`` says (the driver lists them all, whether the instances exist or not).
    Devices whose minors were chosen by hand are listed with those minors instead."""
    chosen = {
        (gpu.minor, device.gpu_instance_id): device
        for gpu in config.gpus
        for device in gpu.mig_devices
    }
    lines = ["config 1", "monitor 2"]
    for gpu in config.gpus:
        if gpu.mig is MigMode.UNSUPPORTED:
            continue
        for gi in range(_MAX_GPU_INSTANCE_ID + 1):
            device = chosen.get((gpu.minor, gi))
            gi_minor, _ = mig_caps_minors(gpu.minor, gi, 0)
            lines.append(
                f"gpu{gpu.minor}/gi{gi}/access {device.gi_access_minor if device else gi_minor}"
            )
            for ci in range(_MAX_COMPUTE_INSTANCE_ID + 1):
                _, ci_minor = mig_caps_minors(gpu.minor, gi, ci)
                if device is not None and device.compute_instance_id == ci:
                    ci_minor = device.ci_access_minor
                lines.append(f"gpu{gpu.minor}/gi{gi}/ci{ci}/access {ci_minor}")
    return "\n".join(lines) + "\n"


# ----- the text format -----------------------------------------------------------------------


def _render_gpu(gpu: SimulatedGpu) -> Iterator[str]:
    major, minor = gpu.compute_capability
    yield "[gpu]"
    yield f"uuid={gpu.uuid}"
    yield f"minor={gpu.minor}"
    yield f"name={gpu.name}"
    yield f"pci_bus_id={gpu.pci_bus_id}"
    yield f"pci_device_id=0x{gpu.pci_device_id:08X}"
    yield f"memory_total={gpu.memory_total}"
    yield f"memory_used={gpu.memory_used}"
    yield f"utilization_gpu={gpu.utilization_gpu}"
    yield f"utilization_memory={gpu.utilization_memory}"
    yield f"temperature={gpu.temperature}"
    yield f"power_usage={gpu.power_usage}"
    yield f"power_limit={gpu.power_limit}"
    yield f"compute_capability={major}.{minor}"
    yield _render_processes(gpu.processes)
    yield f"lost={int(gpu.lost)}"
    yield f"mig={gpu.mig}"
    yield f"pcie_tx={gpu.pcie_tx}"
    yield f"pcie_rx={gpu.pcie_rx}"
    yield f"nvlinks={gpu.nvlinks}"
    yield f"nvlink_tx={gpu.nvlink_tx}"
    yield f"nvlink_rx={gpu.nvlink_rx}"
    for device in gpu.mig_devices:
        yield from _render_mig(device)


def _render_process(process: SimulatedProcess) -> str:
    used = _NOT_AVAILABLE if process.used_memory is None else process.used_memory
    util = "" if process.sm_util is None else f":{process.sm_util}"
    return f"{process.pid}:{used}{util}"


def _render_processes(processes: Iterable[SimulatedProcess]) -> str:
    return "processes=" + ",".join(_render_process(p) for p in processes)


def _render_mig(device: SimulatedMigDevice) -> Iterator[str]:
    yield "[mig]"
    yield f"uuid={device.uuid}"
    yield f"profile={device.profile}"
    yield f"gpu_instance_id={device.gpu_instance_id}"
    yield f"compute_instance_id={device.compute_instance_id}"
    yield f"placement_start={device.placement_start}"
    yield f"gi_access_minor={device.gi_access_minor}"
    yield f"ci_access_minor={device.ci_access_minor}"
    yield f"name={device.name}"
    yield f"memory_total={device.memory_total}"
    yield f"memory_used={device.memory_used}"
    yield _render_processes(device.processes)


def render_config(config: FakeNvmlConfig) -> str:
    """The file text for ``config``; ``parse_config`` gives back an equal value."""
    lines = [
        "# Simulated NVIDIA GPUs for jupyter-gpu-hotplug's fake libnvidia-ml.so.1.",
        f"version={FORMAT_VERSION}",
        f"driver_version={config.driver_version}",
        f"cuda_driver_version={config.cuda_driver_version}",
    ]
    for gpu in config.gpus:
        lines.append("")
        lines.extend(_render_gpu(gpu))
    return "\n".join(lines) + "\n"


class _Parser:
    """Line-by-line reader with the C parser's rules; errors name the source and line."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.line = 0

    def fail(self, message: str) -> FakeNvmlConfigError:
        where = f"{self.source}:{self.line}" if self.line else self.source
        return FakeNvmlConfigError(f"{where}: {message}")

    def uint(self, key: str, value: str) -> int:
        if _DECIMAL.fullmatch(value) is None:
            raise self.fail(f"{key} {value}: expected a whole number")
        return int(value)

    def parse(self, text: str) -> FakeNvmlConfig:
        globals_: dict[str, str] = {}
        sections: list[_Section] = []
        current = globals_
        have_version = False
        for self.line, raw in enumerate(text.split("\n"), start=1):
            line = raw.strip(_WHITESPACE)
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                if line not in ("[gpu]", "[mig]"):
                    raise self.fail(f"unknown section {line}")
                if not have_version:
                    raise self.fail(f"the first setting must be version={FORMAT_VERSION}")
                current = {}
                if line == "[gpu]":
                    sections.append(_Section(self.line, current))
                elif not sections:
                    raise self.fail("a [mig] section must follow the [gpu] it belongs to")
                else:
                    sections[-1].migs.append((self.line, current))
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise self.fail("expected key=value, [gpu] or [mig]")
            key, value = key.strip(_WHITESPACE), value.strip(_WHITESPACE)
            if not have_version:
                if key != "version":
                    raise self.fail(f"the first setting must be version={FORMAT_VERSION}")
                if value != str(FORMAT_VERSION):
                    raise self.fail(
                        f"unsupported format version {value} "
                        f"(this reader knows version {FORMAT_VERSION})"
                    )
                have_version = True
                continue
            if current is globals_:
                allowed, kind = _GLOBAL_KEYS, "global"
            elif sections and any(current is mig for _, mig in sections[-1].migs):
                allowed, kind = _MIG_KEYS, "MIG"
            else:
                allowed, kind = _GPU_KEYS, "GPU"
            if key not in allowed:
                raise self.fail(f"unknown {kind} key {key}")
            if key in current:
                raise self.fail(f"{key} given twice")
            current[key] = value
        if not have_version:
            self.line = 0
            raise self.fail(f"no version={FORMAT_VERSION} line (is this a fake NVML config?)")
        gpus = [self.gpu(section) for section in sections]
        self.line = 0
        try:
            return FakeNvmlConfig(
                gpus=tuple(gpus),
                driver_version=globals_.get("driver_version", DEFAULT_DRIVER_VERSION),
                cuda_driver_version=self.uint(
                    "cuda_driver_version",
                    globals_.get("cuda_driver_version", str(DEFAULT_CUDA_DRIVER_VERSION)),
                ),
            )
        except FakeNvmlConfigError as error:
            raise self.fail(str(error)) from error

    def gpu(self, section: _Section) -> SimulatedGpu:
        devices = tuple(self.mig_device(values) for self.line, values in section.migs)
        self.line = section.line
        for required in ("uuid", "minor"):
            if required not in section.values:
                raise self.fail(f"GPU section without {required}")
        values: dict[str, object] = {
            key: self.gpu_value(key, value) for key, value in section.values.items()
        }
        try:
            return SimulatedGpu(**values, mig_devices=devices)  # type: ignore[arg-type]
        except FakeNvmlConfigError as error:
            raise self.fail(str(error)) from error

    def mig_device(self, section: dict[str, str]) -> SimulatedMigDevice:
        for required in _MIG_REQUIRED:
            if required not in section:
                raise self.fail(f"MIG section without {required}")
        values: dict[str, object] = {}
        for key, value in section.items():
            if key in ("uuid", "profile", "name"):
                values[key] = value
            elif key == "processes":
                values[key] = self.processes(value)
            else:
                values[key] = self.uint(key, value)
        try:
            return SimulatedMigDevice(**values)  # type: ignore[arg-type]  # checked by __post_init__
        except FakeNvmlConfigError as error:
            raise self.fail(str(error)) from error

    def gpu_value(self, key: str, value: str) -> object:
        if key in ("uuid", "name", "pci_bus_id"):
            return value
        if key == "pci_device_id":
            hex_match = _HEX.fullmatch(value)
            return int(hex_match["digits"], 16) if hex_match else self.uint(key, value)
        if key == "compute_capability":
            major, dot, minor = value.partition(".")
            if not dot:
                raise self.fail("compute_capability: expected MAJOR.MINOR")
            return (self.uint(key, major), self.uint(key, minor))
        if key == "processes":
            return self.processes(value)
        if key == "lost":
            lowered = value.lower()
            if lowered not in ("0", "1", "true", "false", "yes", "no"):
                raise self.fail(f"lost {value}: expected 0 or 1")
            return lowered in ("1", "true", "yes")
        if key == "mig":
            if value not in set(MigMode):
                raise self.fail(f"mig {value}: expected {', '.join(MigMode)}")
            return MigMode(value)
        return self.uint(key, value)

    def processes(self, value: str) -> tuple[SimulatedProcess, ...]:
        return tuple(self.process(item) for item in value.split(",")) if value else ()

    def process(self, item: str) -> SimulatedProcess:
        pid, sep, rest = (part.strip(_WHITESPACE) for part in item.partition(":"))
        if not sep:
            raise self.fail(f"process {item.strip(_WHITESPACE)}: expected pid:used_bytes")
        used, util_sep, util = (part.strip(_WHITESPACE) for part in rest.partition(":"))
        try:
            used_memory = None if used == _NOT_AVAILABLE else self.uint("used_memory", used)
            sm_util = self.uint("sm_util", util) if util_sep else None
            return SimulatedProcess(self.uint("pid", pid), used_memory, sm_util)
        except FakeNvmlConfigError as error:
            raise self.fail(f"process {item.strip(_WHITESPACE)}: {error}") from error


@dataclass
class _Section:
    """A ``[gpu]`` section being read: its keys, and the ``[mig]`` sections below it."""

    line: int
    values: dict[str, str]
    migs: list[tuple[int, dict[str, str]]] = dataclasses.field(default_factory=list)


_GPU_KEYS: Final = frozenset(f.name for f in fields(SimulatedGpu)) - {"mig_devices"}
_MIG_KEYS: Final = frozenset(f.name for f in fields(SimulatedMigDevice))
_MIG_REQUIRED: Final = ("uuid", "profile", "gpu_instance_id", "gi_access_minor", "ci_access_minor")
_GLOBAL_KEYS: Final = frozenset({"driver_version", "cuda_driver_version"})


def parse_config(text: str, *, source: str = "<config>") -> FakeNvmlConfig:
    """Read config text with the same rules as the C library; errors name ``source:line``."""
    return _Parser(source).parse(text)


# ----- files ---------------------------------------------------------------------------------


def write_config(path: Path, config: FakeNvmlConfig | Iterable[SimulatedGpu]) -> None:
    """Replace ``path`` atomically with ``config`` (or a default node with these GPUs).

    Temp file in the same directory, then ``os.replace``: a reader sees the old or the new file,
    never half of one, and the library notices the new inode on its next call. The file is
    made world-readable because simulated kernels may run as another user than the writer.
    No fsync: a simulation has nothing to preserve across a power cut.
    """
    if not isinstance(config, FakeNvmlConfig):
        config = FakeNvmlConfig(gpus=tuple(config))
    text = render_config(config)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as temp:
            temp.write(text)
            os.fchmod(temp.fileno(), 0o644)
        os.replace(temp_name, path)
    except BaseException:
        os.unlink(temp_name)
        raise


def read_config(path: Path) -> FakeNvmlConfig:
    """Parse the config file at ``path``; ``FakeNvmlConfigError`` names the line at fault."""
    return parse_config(path.read_text(encoding="utf-8"), source=str(path))
