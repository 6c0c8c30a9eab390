"""``--simulate N``: the agent's GPUs come from the fake NVML of ``nvml.sim``, and they move.

Why it exists: the demo, the end-to-end tests and development machines have no GPU, yet the
agent must run its real code paths (pynvml, the inventory, the engine with NVIDIA's major 195).
This module prepares a simulated node before NVML is first initialised — builds the fake
``libnvidia-ml.so.1`` if needed, writes the config with ``default_gpus(N)`` (stable UUIDs,
minors ``0..N-1``) and makes the fake the NVML of this process — and then keeps it alive: a
periodic task moves utilisation, memory use, temperature, power and the PCIe and NVLink
traffic. A simulated GPU works only
while a process of the container it is attached to *uses* it — holds its ``/dev/nvidia<minor>``
open, as a CUDA program would (with no driver, the demo's load helper
``python -m jupyter_gpu_hotplug.nvml.sim.load`` holds it with ``O_PATH``) — found by the same
device-node scan that makes a detach refuse a busy GPU. Otherwise it idles: 0 %, no memory in
use, idle power. A process that holds it only through a CUDA context of the simulated driver
(``fakeCudaHoldContext``: the simulated driver knows its device memory) does no work by
itself, as an idle PyTorch kernel does none: NVML lists it with its context's memory at 0 %,
and the GPU works only while another process uses it (issue 39's idle suspend needs that
idle context to be seen). Every line it logs says SIMULATED. The processes that hold a GPU
are what its NVML lists on it, with the GPU's memory in use and its utilisation shared among
them (the per-process samples of ``nvmlDeviceGetProcessUtilization``), so per-kernel
attribution has the same inputs as on hardware: pids as the agent (the host) sees them.

Processes that should see the simulated GPUs (kernels in sandboxes) get ``environ()``: the
library path, the config, and the device filter that hides GPUs whose ``/dev/nvidia<minor>``
they lack, like NVML inside a container.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..._structs import GpuUuid
from ...linux.devnodes import parse_proc_devices
from ...nvml.sim import (
    CONFIG_ENV,
    CUDA_LIBRARY_NAME,
    MAX_PROCESSES,
    FakeNvmlConfig,
    SimulatedGpu,
    SimulatedProcess,
    default_gpus,
    ensure_fake_cuda,
    ensure_fake_nvml,
    fake_nvml_environ,
    load_in_process,
    read_config,
    render_mig_minors,
    with_mig_devices,
    with_nvlinks,
    write_config,
)

__all__ = [
    "CONFIG_NAME",
    "MIG_MINORS_NAME",
    "PROC_DEVICES_NAME",
    "Simulation",
    "drift",
    "write_caps_tables",
]

log = logging.getLogger(__name__)

CONFIG_NAME = "fake-nvml.conf"
PROC_DEVICES_NAME = "devices"
MIG_MINORS_NAME = "mig-minors"
_LOCAL_MAJORS = range(240, 255)
"""Char majors Linux keeps for local use: the simulated ``nvidia-caps`` major is a free one,
so a capability node opens with ENXIO where the cgroup allows it, as a GPU's node does."""
_CACHE_NAME = "build"
ContextMemory = Callable[[int], int | None]
"""Device memory of the CUDA context a process holds, or None where it holds none (blocking:
the simulated driver's ``fakeCudaProcessMemory``, ``CudaCheckpoint.device_memory``)."""
_PCIE_KB_PER_PERCENT = 120_000
"""PCIe traffic received per percent of utilisation (KB/s): about 12 GB/s at 100 %, what a
training job's input pipeline moves over PCIe Gen5 (~50 GB/s usable); sent is a quarter."""
_NVLINK_KIB_PER_PERCENT = 3_000_000
"""NVLink traffic each way per percent (KiB/s): about 300 GiB/s at 100 %, a collective-heavy
job on an H100 SXM (450 GB/s each way at most)."""


def write_caps_tables(
    config: FakeNvmlConfig, *, proc_devices: Path, mig_minors: Path, host_proc_devices: Path
) -> int:
    """Write the two driver tables a MIG node has beside its NVML — ``/proc/devices`` with an
    ``nvidia-caps`` major, and ``/proc/driver/nvidia-caps/mig-minors`` for ``config`` — to the
    given paths, and return the major. It is a char major for local use that
    ``host_proc_devices`` does not list, so that a capability node opens with ENXIO where a
    device cgroup allows it, as a GPU's node does without a driver. The real-node tests mount
    the same tables over the host's for NVIDIA's device plugin and the agent."""
    taken = set(parse_proc_devices(host_proc_devices.read_text()).values())
    major = next(m for m in _LOCAL_MAJORS if m not in taken)
    mig_minors.parent.mkdir(parents=True, exist_ok=True)
    proc_devices.write_text(f"Character devices:\n195 nvidia-frontend\n{major} nvidia-caps\n")
    mig_minors.write_text(render_mig_minors(config))
    return major


@dataclass(frozen=True)
class Simulation:
    """A prepared simulated node: where its library and config are."""

    library_dir: Path
    config_path: Path
    count: int
    proc_devices: Path | None = None
    """With MIG slices: the simulated node's ``/proc/devices`` (its ``nvidia-caps`` major)."""
    mig_minors: Path | None = None
    """With MIG slices: the simulated ``/proc/driver/nvidia-caps/mig-minors``."""

    @classmethod
    def prepare(
        cls,
        directory: Path,
        count: int,
        *,
        cache_dir: Path | None = None,
        node: str = "simulated-node",
        mig_profiles: Sequence[str] = (),
        nvlink_gpus: int = 0,
        host_proc_devices: Path = Path("/proc/devices"),
    ) -> Simulation:
        """Build the fake NVML (once), write ``count`` idle GPUs to ``directory``'s config.

        ``mig_profiles`` puts GPU 0 in MIG mode with one slice per profile, and writes the
        node's capability tables beside the config: a ``devices`` file with an ``nvidia-caps``
        major that ``host_proc_devices`` does not list, and ``mig-minors``. ``nvlink_gpus``:
        how many GPUs, from GPU 0, have NVLinks (18, as an H100 SXM); the others are PCIe-only.

        The directory is made world-readable (0755): processes of other users must load the
        library and read the config. Raises ``nvml.sim.FakeNvmlError`` subclasses.
        """
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o755)
        library_dir = ensure_fake_nvml(cache_dir or directory / _CACHE_NAME)
        config_path = directory / CONFIG_NAME
        gpus = list(default_gpus(count, node=node))
        if mig_profiles and gpus:
            gpus[0] = with_mig_devices(gpus[0], mig_profiles, node=node)
        gpus[:nvlink_gpus] = [with_nvlinks(gpu) for gpu in gpus[:nvlink_gpus]]
        config = FakeNvmlConfig(gpus=tuple(gpus))
        write_config(config_path, config)
        log.warning(
            "SIMULATED: %d simulated GPU(s), no hardware behind them (config %s)",
            count,
            config_path,
        )
        if not mig_profiles:
            return cls(library_dir=library_dir, config_path=config_path, count=count)
        proc_devices = directory / PROC_DEVICES_NAME
        mig_minors = directory / MIG_MINORS_NAME
        major = write_caps_tables(
            config,
            proc_devices=proc_devices,
            mig_minors=mig_minors,
            host_proc_devices=host_proc_devices,
        )
        log.warning(
            "SIMULATED: GPU 0 in MIG mode with %s; nvidia-caps major %d",
            ", ".join(mig_profiles),
            major,
        )
        return cls(library_dir, config_path, count, proc_devices, mig_minors)

    def load_in_process(self) -> None:
        """Make the fake this process's NVML; call before pynvml's first ``nvmlInit``.

        The library reads its config from the environment at ``nvmlInit``, so this sets
        ``FAKE_NVML_CONFIG`` for this process (its children inherit it).
        """
        os.environ[CONFIG_ENV] = str(self.config_path)
        load_in_process(self.library_dir)

    def cuda_library(self) -> Path:
        """The simulated CUDA driver (``libcuda.so.1``, built once in the fake NVML's cache):
        the library whose checkpoint calls the agent makes in simulation."""
        return ensure_fake_cuda(self.library_dir.parent) / CUDA_LIBRARY_NAME

    def environ(
        self, *, device_filter: Path | None = Path("/dev"), base: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """The environment of a process that should see the simulated GPUs it has nodes for."""
        return fake_nvml_environ(
            self.library_dir, self.config_path, device_filter=device_filter, base=base
        )

    async def animate(
        self,
        *,
        interval: float,
        in_use: Callable[[], Awaitable[Mapping[GpuUuid, Sequence[int]]]],
        context_memory: ContextMemory | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """Move the simulated readings every ``interval`` seconds until cancelled.

        ``in_use``: the GPUs a process uses now, with the pids that use each (they work; the
        others idle). ``context_memory``: of those pids, the device memory of the ones that
        hold a GPU only through a CUDA context (idle: they do no work by themselves).
        """
        rng = rng or random.Random()
        # The users each GPU's processes were written for last time: ours to replace.
        listed: Mapping[GpuUuid, Sequence[int]] = {}
        while True:
            await asyncio.sleep(interval)
            try:
                busy = await in_use()
                contexts = (
                    {}
                    if context_memory is None
                    else await asyncio.to_thread(_contexts, busy, context_memory)
                )
                config = await asyncio.to_thread(read_config, self.config_path)
                moved = dataclasses.replace(
                    config,
                    gpus=tuple(
                        drift(
                            gpu,
                            busy.get(gpu.uuid, ()),
                            rng,
                            ours=listed.get(gpu.uuid, ()),
                            contexts=contexts,
                        )
                        for gpu in config.gpus
                    ),
                )
                await asyncio.to_thread(write_config, self.config_path, moved)
                listed = busy
            except Exception:
                log.exception("SIMULATED: moving the simulated readings failed; trying again")


def _contexts(
    busy: Mapping[GpuUuid, Sequence[int]], context_memory: ContextMemory
) -> dict[int, int]:
    """The device memory of each pid in ``busy`` that holds its GPU through a CUDA context."""
    found = {}
    for pid in {pid for pids in busy.values() for pid in pids}:
        memory = context_memory(pid)
        if memory is not None:
            found[pid] = memory
    return found


def _toward(value: int, goal: int, rng: random.Random, *, step: int, low: int, high: int) -> int:
    """One bounded random step from ``value`` in the direction of ``goal``."""
    pull = (goal - value) // 3
    return max(low, min(high, value + pull + rng.randint(-step, step)))


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def drift(
    gpu: SimulatedGpu,
    pids: Sequence[int],
    rng: random.Random,
    *,
    ours: Collection[int] = (),
    alive: Callable[[int], bool] = _alive,
    contexts: Mapping[int, int] | None = None,
) -> SimulatedGpu:
    """The next readings of one simulated GPU: a GPU that processes ``pids`` use works, any
    other idles. NVML lists those processes, sharing the memory in use and the utilisation
    evenly (the first ones get the remainders). ``ours``: the users the last step listed,
    which this step replaces; a process someone else listed (a test, an operator) stays as
    it was while it is ``alive``, and leaves the list when it ends, as it does NVML's.
    ``contexts``: pids that hold a GPU only through an idle CUDA context, with its device
    memory: listed with that memory at 0 %, they make no GPU work (nor the memory climb)."""
    contexts = contexts or {}
    idle = [pid for pid in pids if pid in contexts]
    pids = [pid for pid in pids if pid not in contexts]
    held = sum(contexts[pid] for pid in idle)
    busy = bool(pids)
    # Unused: utilisation halves each step to exactly 0 (no noise: an idle GPU reads 0 %).
    utilization = (
        _toward(gpu.utilization_gpu, rng.randint(55, 98), rng, step=6, low=0, high=100)
        if busy
        else gpu.utilization_gpu // 2
    )
    memory_goal = held + gpu.memory_total * (rng.randint(20, 70) if busy else 0) // 100
    # The contexts' memory is taken at once (it is allocated, not a reading that moves).
    memory_used = min(gpu.memory_total, max(held, (gpu.memory_used * 3 + memory_goal) // 4))
    temperature = _toward(
        gpu.temperature, 35 + utilization * 45 // 100, rng, step=1, low=25, high=95
    )
    idle_power = gpu.power_limit // 10
    power_goal = idle_power + (gpu.power_limit - idle_power) * utilization // 100
    power = max(0, min(gpu.power_limit or power_goal, (gpu.power_usage + power_goal) // 2))

    def traffic(now: int, per_percent: int) -> int:
        """Half way to what this utilisation moves (±15 %): an idle GPU's traffic halves
        to exactly 0, as its utilisation does."""
        goal = utilization * per_percent * rng.randint(85, 115) // 100 if busy else 0
        return (now + goal) // 2

    linked = gpu.nvlinks > 0
    return dataclasses.replace(
        gpu,
        utilization_gpu=utilization,
        utilization_memory=min(100, utilization * 2 // 3),
        memory_used=memory_used,
        temperature=temperature,
        power_usage=power,
        processes=(
            _others(gpu, {*pids, *idle, *ours}, alive)
            + tuple(SimulatedProcess(pid, contexts[pid], 0) for pid in idle)
            + _shares(pids, max(0, memory_used - held), utilization)
        )[:MAX_PROCESSES],
        pcie_tx=traffic(gpu.pcie_tx, _PCIE_KB_PER_PERCENT // 4),
        pcie_rx=traffic(gpu.pcie_rx, _PCIE_KB_PER_PERCENT),
        nvlink_tx=traffic(gpu.nvlink_tx, _NVLINK_KIB_PER_PERCENT) if linked else 0,
        nvlink_rx=traffic(gpu.nvlink_rx, _NVLINK_KIB_PER_PERCENT) if linked else 0,
    )


def _others(
    gpu: SimulatedGpu, replaced: Collection[int], alive: Callable[[int], bool]
) -> tuple[SimulatedProcess, ...]:
    """The processes someone else listed on ``gpu`` that still live (room left for ours)."""
    kept = [p for p in gpu.processes if p.pid not in replaced and alive(p.pid)]
    return tuple(kept[: MAX_PROCESSES - min(len(replaced), MAX_PROCESSES)])


def _shares(pids: Sequence[int], memory: int, utilization: int) -> tuple[SimulatedProcess, ...]:
    """``pids`` as NVML's processes, each with an even share of ``memory`` and ``utilization``."""
    pids = pids[:MAX_PROCESSES]
    if not pids:
        return ()
    memory_each, memory_rest = divmod(memory, len(pids))
    util_each, util_rest = divmod(utilization, len(pids))
    return tuple(
        SimulatedProcess(
            pid,
            memory_each + (i < memory_rest),
            util_each + (i < util_rest),
        )
        for i, pid in enumerate(pids)
    )
