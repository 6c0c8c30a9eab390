"""``--simulate N``: a simulated GPU works only while a process uses it, and idles otherwise.

The readings are the fake NVML's config file, which the animation rewrites; ``in_use`` stands
in for the agent's scan of open device nodes (``IdleReleaser.held_gpus``, tested with the
idle policy), so what is proven here is the animation's rule, with the real file and library.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from pathlib import Path

from jupyter_gpu_hotplug._structs import GpuUuid
from jupyter_gpu_hotplug.agent.local.simulate import Simulation, drift
from jupyter_gpu_hotplug.nvml.sim import default_gpus, read_config
from tests.fixtures.waiting import eventually


def test_an_unused_gpu_drifts_to_idle_values() -> None:
    rng = random.Random(7)
    gpu = default_gpus(1)[0]
    for _ in range(50):
        gpu = drift(gpu, False, rng)
    assert (gpu.utilization_gpu, gpu.utilization_memory, gpu.memory_used) == (0, 0, 0)
    assert gpu.power_usage <= gpu.power_limit // 10


def test_traffic_rises_with_load_and_nvlink_only_where_there_are_links() -> None:
    """PCIe traffic follows the work (received more than sent, as a job's input does), NVLink
    traffic exists only on a GPU with NVLinks, and both fall to exactly 0 when it idles."""
    rng = random.Random(5)
    linked, unlinked = default_gpus(2)
    linked = dataclasses.replace(linked, nvlinks=18)
    for _ in range(10):
        linked, unlinked = drift(linked, True, rng), drift(unlinked, True, rng)
    assert linked.pcie_rx > linked.pcie_tx > 0
    assert unlinked.pcie_rx > 0
    assert linked.nvlink_tx > 0 and linked.nvlink_rx > 0
    assert (unlinked.nvlink_tx, unlinked.nvlink_rx) == (0, 0)
    for _ in range(60):
        linked = drift(linked, False, rng)
    assert (linked.pcie_tx, linked.pcie_rx, linked.nvlink_tx, linked.nvlink_rx) == (0, 0, 0, 0)


def test_nvlink_gpus_are_the_first(tmp_path: Path, fake_nvml_library: Path) -> None:
    simulation = Simulation.prepare(
        tmp_path / "sim", 3, cache_dir=fake_nvml_library.parent, nvlink_gpus=1
    )
    assert [gpu.nvlinks for gpu in read_config(simulation.config_path).gpus] == [18, 0, 0]


async def test_only_the_gpu_in_use_works(tmp_path: Path, fake_nvml_library: Path) -> None:
    simulation = Simulation.prepare(tmp_path / "sim", 2, cache_dir=fake_nvml_library.parent)
    used, unused = (gpu.uuid for gpu in read_config(simulation.config_path).gpus)
    asked = 0

    async def in_use() -> set[GpuUuid]:
        nonlocal asked
        asked += 1
        return {used}

    task = asyncio.create_task(
        simulation.animate(interval=0.001, in_use=in_use, rng=random.Random(3))
    )
    try:
        await eventually(
            lambda: read_config(simulation.config_path).gpu(used).utilization_gpu > 0,
            "the GPU in use works",
        )
        await eventually(lambda: asked >= 20, "twenty animation steps")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    config = read_config(simulation.config_path)
    assert config.gpu(used).memory_used > 0
    idle = config.gpu(unused)
    assert (idle.utilization_gpu, idle.memory_used) == (0, 0)
