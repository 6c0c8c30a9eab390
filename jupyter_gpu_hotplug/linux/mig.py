"""What a container needs to use one MIG slice, read from the driver's own tables.

Why this module exists: a MIG device is not a device node of its own. A process uses it
through its GPU's node (``/dev/nvidia<minor>``) and ``nvidiactl``, and the driver lets it in
only when it may open the *capability* nodes of the slice's GPU instance and compute
instance, ``/dev/nvidia-caps/nvidia-cap<N>`` (the ``/dev`` based capability mode, the default
since driver R450; NVIDIA's MIG user guide, "Device Nodes and Capabilities"). Their numbers
are the driver's: the ``nvidia-caps`` major is dynamic (``/proc/devices``), and the minors
are listed in ``/proc/driver/nvidia-caps/mig-minors``, one line per capability::

    config 1
    monitor 2
    gpu0/gi1/access 12
    gpu0/gi1/ci0/access 13

where ``gpu<G>`` is the GPU's driver minor, ``gi<I>`` the GPU instance id and ``ci<C>`` the
compute instance id (the same file NVIDIA's container toolkit reads). So granting a slice is
granting those device nodes through the engine, and taking it back is revoking exactly the
slice's two capability nodes, plus the GPU's node only when no other slice of that GPU stays
with the container. ``config`` and ``monitor`` (creating instances, watching all of them)
are never handed out.

Boundary: parsing and pure values. The two files are read from paths the caller passes (the
host's procfs as the agent sees it; test files in tests), never from host globals.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from .devnodes import CAPS_DIR, DeviceNode, parse_proc_devices
from .devrules import CharDevice

__all__ = [
    "CAPS_DRIVER",
    "CAPS_NODE_MODE",
    "MIG_MINORS",
    "MigAccess",
    "MigCaps",
    "MigCapsError",
    "MigMinors",
    "caps_major",
    "parse_mig_minors",
    "read_mig_minors",
    "revoke_nodes",
]

CAPS_DRIVER: Final = "nvidia-caps"
"""The driver name of the capability nodes in ``/proc/devices``."""
MIG_MINORS: Final = Path("/proc/driver/nvidia-caps/mig-minors")
CAPS_NODE_MODE: Final = 0o444
"""The mode the driver's tools give ``nvidia-cap<N>`` nodes: access is the cgroup's decision."""

_GPU_INSTANCE: Final = re.compile(r"gpu(?P<gpu>[0-9]+)/gi(?P<gi>[0-9]+)/access")
_COMPUTE_INSTANCE: Final = re.compile(
    r"gpu(?P<gpu>[0-9]+)/gi(?P<gi>[0-9]+)/ci(?P<ci>[0-9]+)/access"
)
_MINORMASK: Final = 2**20 - 1  # the widest minor Linux has


class MigCapsError(Exception):
    """The capability tables are missing, malformed, or lack an instance."""


@dataclass(frozen=True)
class MigMinors:
    """``/proc/driver/nvidia-caps/mig-minors`` as values."""

    config: int | None
    monitor: int | None
    gpu_instances: Mapping[tuple[int, int], int]
    """(GPU minor, GPU instance id) → minor of ``gpu<G>/gi<I>/access``."""
    compute_instances: Mapping[tuple[int, int, int], int]
    """(GPU minor, GPU instance id, compute instance id) → minor of its ``access``."""


def parse_mig_minors(text: str, *, source: str = "mig-minors") -> MigMinors:
    """Parse the minors file. Every line is ``<capability> <minor>``; a capability of another
    form than the four above is skipped (a newer driver may list more), a line that is not
    two fields with a decimal minor is an error (the file is not what we think it is)."""
    config = monitor = None
    gpu_instances: dict[tuple[int, int], int] = {}
    compute_instances: dict[tuple[int, int, int], int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].isdigit() or int(fields[1]) > _MINORMASK:
            raise MigCapsError(f"{source}:{number}: expected '<capability> <minor>': {line!r}")
        name, minor = fields[0], int(fields[1])
        if name == "config":
            config = minor
        elif name == "monitor":
            monitor = minor
        elif match := _GPU_INSTANCE.fullmatch(name):
            gpu_instances[int(match["gpu"]), int(match["gi"])] = minor
        elif match := _COMPUTE_INSTANCE.fullmatch(name):
            key = (int(match["gpu"]), int(match["gi"]), int(match["ci"]))
            compute_instances[key] = minor
    return MigMinors(config, monitor, gpu_instances, compute_instances)


def read_mig_minors(path: Path = MIG_MINORS) -> MigMinors:
    """Read and parse the minors file at ``path``; :class:`MigCapsError` if it cannot be
    read (a host without MIG-capable GPUs or without the driver has none)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise MigCapsError(f"cannot read {path}: {e.strerror}") from e
    return parse_mig_minors(text, source=str(path))


def caps_major(proc_devices: Path) -> int:
    """The ``nvidia-caps`` major from ``proc_devices`` (the host's ``/proc/devices``)."""
    try:
        majors = parse_proc_devices(proc_devices.read_text())
    except OSError as e:
        raise MigCapsError(f"cannot read {proc_devices}: {e.strerror}") from e
    if CAPS_DRIVER not in majors:
        raise MigCapsError(
            f"no {CAPS_DRIVER} driver in {proc_devices}: is the NVIDIA driver loaded, with MIG "
            "capabilities exposed as device nodes (nv_cap_enable_devfs=1, the default)?"
        )
    return majors[CAPS_DRIVER]


@dataclass(frozen=True)
class MigAccess:
    """The device nodes that make one MIG slice usable in a container."""

    gpu: DeviceNode
    """The slice's GPU, ``/dev/nvidia<minor>`` (``nvidiactl`` comes with the engine's control
    nodes, as for a whole GPU)."""
    gpu_instance: DeviceNode
    """``nvidia-caps/nvidia-cap<N>`` of ``gpu<G>/gi<I>/access``."""
    compute_instance: DeviceNode
    """``nvidia-caps/nvidia-cap<N>`` of ``gpu<G>/gi<I>/ci<C>/access``."""

    @property
    def nodes(self) -> tuple[DeviceNode, ...]:
        """What a grant gives: the GPU's node, then the two capability nodes."""
        return (self.gpu, self.gpu_instance, self.compute_instance)


@dataclass(frozen=True)
class MigCaps:
    """The host's capability numbering: the ``nvidia-caps`` major and the minors file."""

    major: int
    minors: MigMinors

    @classmethod
    def read(cls, *, proc_devices: Path, mig_minors: Path = MIG_MINORS) -> MigCaps:
        """Both tables from the given paths (the host's ``/proc`` as the agent sees it)."""
        return cls(caps_major(proc_devices), read_mig_minors(mig_minors))

    def access(
        self, gpu: DeviceNode, *, gpu_instance_id: int, compute_instance_id: int
    ) -> MigAccess:
        """The nodes of the slice ``gpu<G>/gi<gpu_instance_id>/ci<compute_instance_id>`` of the
        GPU whose node is ``gpu`` (``G`` is its minor); :class:`MigCapsError` if the driver
        lists no such instance."""
        minor = gpu.device.minor
        gi = self.minors.gpu_instances.get((minor, gpu_instance_id))
        ci = self.minors.compute_instances.get((minor, gpu_instance_id, compute_instance_id))
        if gi is None or ci is None:
            raise MigCapsError(
                f"the driver lists no capability for gpu{minor}/gi{gpu_instance_id}"
                f"/ci{compute_instance_id}: is MIG enabled on that GPU?"
            )
        return MigAccess(gpu=gpu, gpu_instance=self._node(gi), compute_instance=self._node(ci))

    def _node(self, minor: int) -> DeviceNode:
        return DeviceNode(
            f"{CAPS_DIR}/nvidia-cap{minor}", CharDevice(self.major, minor), mode=CAPS_NODE_MODE
        )


def revoke_nodes(
    nodes: Iterable[DeviceNode], *, keeping: Iterable[DeviceNode]
) -> tuple[DeviceNode, ...]:
    """What taking ``nodes`` (a slice's ``MigAccess.nodes``, or a GPU's node) back from a
    container revokes, when the container keeps the nodes ``keeping`` (its other slices' and
    GPUs'): a slice's two capability nodes, and the GPU's node only if nothing kept needs it.
    Another slice's capabilities are never touched."""
    kept = {node.device for node in keeping}
    return tuple(node for node in nodes if node.device not in kept)
