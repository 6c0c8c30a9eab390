"""The NVML inventory, through the real ``pynvml`` and the fake ``libnvidia-ml.so.1``.

The inventory must be live (a rewritten config is seen at the next snapshot), label simulated
GPUs, and survive everything a driver can do: a GPU falling off the bus, NVML failing to
initialise — reporting it, never raising.
"""

from __future__ import annotations

from jupyter_gpu_hotplug.agent.core.inventory import NvmlInventory
from jupyter_gpu_hotplug.nvml.sim import SimulatedProcess, default_gpus
from tests.fixtures.nvml import FakeNvml

NVML_ERROR_DRIVER_NOT_LOADED = 9


def test_snapshot_reads_every_gpu(fake_nvml: FakeNvml) -> None:
    inventory = NvmlInventory()
    try:
        snapshot = inventory.snapshot()
    finally:
        inventory.close()

    assert snapshot.unavailable is None
    assert snapshot.lost == ()
    expected = fake_nvml.gpus
    assert [(g.uuid, g.index, g.minor, g.name, g.memory_total) for g in snapshot.gpus] == [
        (s.uuid, i, s.minor, s.name, s.memory_total) for i, s in enumerate(expected)
    ]
    assert all(g.simulated for g in snapshot.gpus)


def test_inventory_is_live(fake_nvml: FakeNvml) -> None:
    inventory = NvmlInventory()
    try:
        assert len(inventory.snapshot().gpus) == 2
        fake_nvml.write(default_gpus(4))
        after = inventory.snapshot()
    finally:
        inventory.close()

    assert [g.minor for g in after.gpus] == [0, 1, 2, 3]


def test_lost_gpu_is_reported_not_raised(fake_nvml: FakeNvml) -> None:
    inventory = NvmlInventory()
    try:
        first, second = inventory.snapshot().gpus
        fake_nvml.update_gpu(second.uuid, lost=True)
        snapshot = inventory.snapshot()
        fake_nvml.update_gpu(second.uuid, lost=False)
        recovered = inventory.snapshot()
    finally:
        inventory.close()

    assert snapshot.gpus == (first,)
    (lost,) = snapshot.lost
    assert (lost.index, lost.last_known) == (1, second)
    assert "lost" in lost.reason.lower()
    assert recovered.gpus == (first, second)
    assert recovered.lost == ()


def test_nvml_failing_to_initialise_means_no_gpus_until_it_works(fake_nvml: FakeNvml) -> None:
    inventory = NvmlInventory(retry_interval=0.0)
    fake_nvml.set_init_error(NVML_ERROR_DRIVER_NOT_LOADED)
    try:
        down = inventory.snapshot()
        fake_nvml.set_init_error(None)
        up = inventory.snapshot()
    finally:
        inventory.close()

    assert down.gpus == () and down.unavailable is not None
    assert "driver" in down.unavailable.lower()
    assert up.unavailable is None and len(up.gpus) == 2


def test_running_pids_by_minor(fake_nvml: FakeNvml) -> None:
    gpu = fake_nvml.gpus[1]
    fake_nvml.update_gpu(
        gpu.uuid, processes=(SimulatedProcess(4242, 2**30), SimulatedProcess(4243, None))
    )
    inventory = NvmlInventory()
    try:
        assert inventory.running_pids(gpu.minor) == [4242, 4243]
        assert inventory.running_pids(fake_nvml.gpus[0].minor) == []
        assert inventory.running_pids(77) == []
    finally:
        inventory.close()
