"""A node's GPUs as the device plugin advertises them, and the matching fake-NVML config.

Why together: the kubelet simulator hands out device ids (``GPU-<uuid>``, ``MIG-<uuid>``), and
the agent maps each id to a ``/dev/nvidia<minor>`` through NVML; the two only agree if both
come from one list. ``nvml_config()`` writes that list for the project's fake NVML.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Final

from jupyter_gpu_hotplug._structs import GpuUuid
from jupyter_gpu_hotplug.nvml.sim import (
    FakeNvmlConfig,
    SimulatedGpu,
    default_gpus,
    with_mig_devices,
)

GPU_RESOURCE: Final = "nvidia.com/gpu"


@dataclass(frozen=True)
class DeviceGpu:
    """One allocatable device: its device-plugin id, its driver minor and its resource."""

    id: str
    """``GPU-…`` (whole GPU) or ``MIG-…`` (MIG instance), as PodResources reports it."""
    minor: int
    """``/dev/nvidia<minor>``: the parent GPU's minor for a MIG instance."""
    resource: str = GPU_RESOURCE


def whole_gpus(count: int, node: str) -> tuple[DeviceGpu, ...]:
    """``count`` whole GPUs with the fake NVML's default UUIDs for ``node``, minors 0..n-1."""
    return tuple(DeviceGpu(str(g.uuid), g.minor) for g in default_gpus(count, node=node))


def mig_devices(
    count: int, node: str, resource: str, parent_minor: int = 0
) -> tuple[DeviceGpu, ...]:
    """``count`` MIG instances (resource such as ``nvidia.com/mig-1g.10gb``) on one GPU."""
    namespace = uuid.uuid5(uuid.NAMESPACE_DNS, f"{node}.mig.k8stier")
    return tuple(
        DeviceGpu(f"MIG-{uuid.uuid5(namespace, f'{resource}/{i}')}", parent_minor, resource)
        for i in range(count)
    )


def simulated_slices(
    count: int, profiles: tuple[str, ...], node: str = "simulated-node"
) -> tuple[DeviceGpu, ...]:
    """The MIG slices of the agent's own simulated node (``--simulate=count
    --simulate-mig=profiles``: GPU 0 in MIG mode, same UUIDs), each advertised as
    ``nvidia.com/mig-<profile>`` on GPU 0's minor: so that PodResources and the agent's NVML
    name the same slices."""
    gpu = with_mig_devices(default_gpus(count, node=node)[0], profiles, node=node)
    return tuple(
        DeviceGpu(str(d.uuid), gpu.minor, f"nvidia.com/mig-{d.profile}") for d in gpu.mig_devices
    )


def nvml_config(devices: tuple[DeviceGpu, ...], node: str) -> FakeNvmlConfig:
    """The fake NVML view of the node: one simulated GPU per distinct minor, carrying the id
    of the whole-GPU device with that minor. This config has no MIG: a MIG instance's parent
    appears as a whole GPU with its default UUID, and the instance's id is unknown to NVML
    (``simulated_slices`` gives the slices that an agent's ``--simulate-mig`` node has)."""
    by_minor: dict[int, str] = {}
    for device in devices:
        if device.id.startswith("GPU-"):
            by_minor[device.minor] = device.id
        else:
            by_minor.setdefault(device.minor, "")
    minors = sorted(by_minor)
    defaults = default_gpus(max(minors) + 1 if minors else 0, node=node)
    gpus: list[SimulatedGpu] = []
    for gpu in defaults:
        if gpu.minor in by_minor:
            chosen = by_minor[gpu.minor] or gpu.uuid
            gpus.append(dataclasses.replace(gpu, uuid=GpuUuid(chosen)))
    return FakeNvmlConfig(gpus=tuple(gpus))
