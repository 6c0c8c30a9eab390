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
    processes=4242:1073741824,4243:na
    lost=0

Every ``[gpu]`` section needs ``uuid`` and ``minor``; other keys default as in
``SimulatedGpu``. A process's memory of ``na`` means NVML reports it as not available.
Unknown or repeated keys are errors, so a typo cannot pass silently.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections.abc import Iterable, Iterator
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
    "MAX_PROCESSES",
    "SIMULATED_SUFFIX",
    "FakeNvmlConfig",
    "GpuModel",
    "GpuUuid",
    "SimulatedGpu",
    "SimulatedProcess",
    "default_gpus",
    "parse_config",
    "read_config",
    "render_config",
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

    def __post_init__(self) -> None:
        _check_int("pid", self.pid, _UINT_MAX, minimum=1)
        if self.used_memory is not None:
            _check_int("used_memory", self.used_memory, _ULLONG_MAX - 1)


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
        if len(self.processes) > MAX_PROCESSES:
            raise FakeNvmlConfigError(f"GPU {self.uuid}: more than {MAX_PROCESSES} processes")
        bus_id = self.pci_bus_id or f"00000000:{self.minor + 1:02X}:00.0"
        # Normalising a frozen field: the one place a frozen dataclass writes itself.
        object.__setattr__(self, "pci_bus_id", _canonical_bus_id(bus_id))
        object.__setattr__(self, "processes", tuple(self.processes))
        object.__setattr__(self, "compute_capability", tuple(self.compute_capability))


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
        for attribute in ("uuid", "minor"):
            values = [getattr(gpu, attribute) for gpu in self.gpus]
            duplicates = sorted({str(v) for v in values if values.count(v) > 1})
            if duplicates:
                raise FakeNvmlConfigError(f"{attribute} appears twice: {', '.join(duplicates)}")

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
    yield "processes=" + ",".join(
        f"{p.pid}:{_NOT_AVAILABLE if p.used_memory is None else p.used_memory}"
        for p in gpu.processes
    )
    yield f"lost={int(gpu.lost)}"


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
        sections: list[tuple[int, dict[str, str]]] = []
        current = globals_
        have_version = False
        for self.line, raw in enumerate(text.split("\n"), start=1):
            line = raw.strip(_WHITESPACE)
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                if line != "[gpu]":
                    raise self.fail(f"unknown section {line}")
                if not have_version:
                    raise self.fail(f"the first setting must be version={FORMAT_VERSION}")
                current = {}
                sections.append((self.line, current))
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise self.fail("expected key=value or [gpu]")
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
            allowed = _GPU_KEYS if current is not globals_ else _GLOBAL_KEYS
            if key not in allowed:
                kind = "GPU" if current is not globals_ else "global"
                raise self.fail(f"unknown {kind} key {key}")
            if key in current:
                raise self.fail(f"{key} given twice")
            current[key] = value
        if not have_version:
            self.line = 0
            raise self.fail(f"no version={FORMAT_VERSION} line (is this a fake NVML config?)")
        gpus = []
        for self.line, section in sections:
            gpus.append(self.gpu(section))
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

    def gpu(self, section: dict[str, str]) -> SimulatedGpu:
        for required in ("uuid", "minor"):
            if required not in section:
                raise self.fail(f"GPU section without {required}")
        values: dict[str, object] = {}
        for key, value in section.items():
            values[key] = self.gpu_value(key, value)
        try:
            return SimulatedGpu(**values)  # type: ignore[arg-type]  # checked by __post_init__
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
            return tuple(self.process(item) for item in value.split(",")) if value else ()
        if key == "lost":
            lowered = value.lower()
            if lowered not in ("0", "1", "true", "false", "yes", "no"):
                raise self.fail(f"lost {value}: expected 0 or 1")
            return lowered in ("1", "true", "yes")
        return self.uint(key, value)

    def process(self, item: str) -> SimulatedProcess:
        pid, sep, used = (part.strip(_WHITESPACE) for part in item.partition(":"))
        if not sep:
            raise self.fail(f"process {item.strip(_WHITESPACE)}: expected pid:used_bytes")
        try:
            used_memory = None if used == _NOT_AVAILABLE else self.uint("used_memory", used)
            return SimulatedProcess(self.uint("pid", pid), used_memory)
        except FakeNvmlConfigError as error:
            raise self.fail(f"process {item.strip(_WHITESPACE)}: {error}") from error


_GPU_KEYS: Final = frozenset(f.name for f in fields(SimulatedGpu))
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
