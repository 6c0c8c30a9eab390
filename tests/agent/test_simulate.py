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
from jupyter_gpu_hotplug.nvml.sim import SimulatedProcess, default_gpus, read_config
from tests.fixtures.waiting import eventually


def test_an_unused_gpu_drifts_to_idle_values() -> None:
    rng = random.Random(7)
    gpu = default_gpus(1)[0]
    for _ in range(50):
        gpu = drift(gpu, (), rng)
    assert (gpu.utilization_gpu, gpu.utilization_memory, gpu.memory_used) == (0, 0, 0)
    assert gpu.power_usage <= gpu.power_limit // 10


def test_traffic_rises_with_load_and_nvlink_only_where_there_are_links() -> None:
    """PCIe traffic follows the work (received more than sent, as a job's input does), NVLink
    traffic exists only on a GPU with NVLinks, and both fall to exactly 0 when it idles."""
    rng = random.Random(5)
    linked, unlinked = default_gpus(2)
    linked = dataclasses.replace(linked, nvlinks=18)
    for _ in range(10):
        linked, unlinked = drift(linked, [101], rng), drift(unlinked, [102], rng)
    assert linked.pcie_rx > linked.pcie_tx > 0
    assert unlinked.pcie_rx > 0
    assert linked.nvlink_tx > 0 and linked.nvlink_rx > 0
    assert (unlinked.nvlink_tx, unlinked.nvlink_rx) == (0, 0)
    for _ in range(60):
        linked = drift(linked, (), rng)
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

    async def in_use() -> dict[GpuUuid, tuple[int, ...]]:
        nonlocal asked
        asked += 1
        return {used: (4242, 4243)}

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
    busy = config.gpu(used)
    assert busy.memory_used > 0
    assert [p.pid for p in busy.processes] == [4242, 4243], "NVML lists the processes using it"
    assert sum(p.used_memory or 0 for p in busy.processes) == busy.memory_used
    assert sum(p.sm_util or 0 for p in busy.processes) == busy.utilization_gpu
    idle = config.gpu(unused)
    assert (idle.utilization_gpu, idle.memory_used, idle.processes) == (0, 0, ())


def test_a_gpu_lists_its_users_and_the_listed_processes_still_alive() -> None:
    """The processes that hold a GPU are what NVML lists, until they stop holding it (even if
    they live on); one listed by someone else (a test, an operator) stays while it lives, and
    leaves the list when it ends."""
    rng = random.Random(5)
    listed = SimulatedProcess(4000, None)
    gpu = dataclasses.replace(default_gpus(1)[0], processes=(listed,))
    running = {4000}

    gpu = drift(gpu, (7, 8, 9), rng, alive=running.__contains__)
    assert [p.pid for p in gpu.processes] == [4000, 7, 8, 9]
    assert gpu.processes[0] == listed, "kept as it was written"

    gpu = drift(gpu, (), rng, ours=(7, 8, 9), alive=lambda pid: True)
    assert gpu.processes == (listed,), "the users stopped (alive or not); the other lives on"
    running.clear()
    assert drift(gpu, (), rng, alive=running.__contains__).processes == ()


def test_a_cuda_context_alone_does_no_work_and_is_listed_with_its_memory() -> None:
    """An idle CUDA context (a PyTorch kernel between cells) holds its GPU and its memory but
    makes no work: the GPU reads exactly 0 % with the context's memory in use, and NVML lists
    the process with that memory; a process doing work beside it makes the GPU work, and the
    context keeps its own memory at 0 %."""
    rng = random.Random(11)
    gpu = default_gpus(1)[0]
    context = 5 * 2**20
    for _ in range(30):
        gpu = drift(gpu, (7,), rng, contexts={7: context})
    assert (gpu.utilization_gpu, gpu.memory_used) == (0, context)
    assert gpu.processes == (SimulatedProcess(7, context, 0),)

    for _ in range(10):
        gpu = drift(gpu, (7, 8), rng, ours=(7,), contexts={7: context})
    assert gpu.utilization_gpu > 0
    idle, working = gpu.processes
    assert idle == SimulatedProcess(7, context, 0)
    assert working.pid == 8 and working.sm_util == gpu.utilization_gpu
    assert (working.used_memory or 0) + context == gpu.memory_used


async def test_the_animation_asks_the_driver_which_users_hold_only_a_context(
    tmp_path: Path, fake_nvml_library: Path
) -> None:
    simulation = Simulation.prepare(tmp_path / "sim", 1, cache_dir=fake_nvml_library.parent)
    (uuid,) = (gpu.uuid for gpu in read_config(simulation.config_path).gpus)
    asked: list[int] = []

    async def in_use() -> dict[GpuUuid, tuple[int, ...]]:
        return {uuid: (4242,)}

    def context_memory(pid: int) -> int | None:
        asked.append(pid)
        return 2**20

    task = asyncio.create_task(
        simulation.animate(
            interval=0.001, in_use=in_use, context_memory=context_memory, rng=random.Random(3)
        )
    )
    try:
        await eventually(lambda: len(asked) >= 20, "twenty animation steps")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    gpu = read_config(simulation.config_path).gpu(uuid)
    assert set(asked) == {4242}
    assert (gpu.utilization_gpu, gpu.memory_used) == (0, 2**20)
    assert gpu.processes == (SimulatedProcess(4242, 2**20, 0),)
