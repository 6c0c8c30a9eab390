"""The unmodified ``pynvml``, in this process, reports exactly the simulated GPUs.

Each test gets a fresh, uninitialised NVML from the ``fake_nvml`` fixture and a config with two
default GPUs that it may rewrite.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings

from jupyter_gpu_hotplug._structs import GpuUuid
from jupyter_gpu_hotplug.nvml.sim import (
    FakeNvmlConfig,
    MigMode,
    SimulatedGpu,
    SimulatedProcess,
    default_gpus,
    is_fake_library,
)
from tests.fixtures.nvml import FakeNvml
from tests.nvml.test_config import configs


@pytest.fixture
def nvml(fake_nvml: FakeNvml) -> Iterator[FakeNvml]:
    """``fake_nvml``, initialised for the test and shut down after it."""
    pynvml.nvmlInit()
    yield fake_nvml
    pynvml.nvmlShutdown()


ALL_LINKS = 0xFFFFFFFF
NVLINK_TOTALS = [
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
]


def assert_reports(gpu: SimulatedGpu, handle: object) -> None:
    """Every simulated field, read back through pynvml's public functions."""
    assert pynvml.nvmlDeviceGetUUID(handle) == gpu.uuid
    assert pynvml.nvmlDeviceGetName(handle) == gpu.name
    assert pynvml.nvmlDeviceGetMinorNumber(handle) == gpu.minor
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    assert (memory.total, memory.used) == (gpu.memory_total, gpu.memory_used)
    assert memory.free == gpu.memory_total - gpu.memory_used
    memory_v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    assert (memory_v2.total, memory_v2.used, memory_v2.reserved) == (
        gpu.memory_total,
        gpu.memory_used,
        0,
    )
    utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
    assert (utilization.gpu, utilization.memory) == (gpu.utilization_gpu, gpu.utilization_memory)
    assert pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == gpu.temperature
    assert pynvml.nvmlDeviceGetPowerUsage(handle) == gpu.power_usage
    assert pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) == gpu.power_limit
    assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) == gpu.power_limit
    assert pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) == gpu.power_limit
    pci = pynvml.nvmlDeviceGetPciInfo_v3(handle)
    assert pci.busId == gpu.pci_bus_id
    assert pci.busIdLegacy == gpu.pci_bus_id[4:]
    assert pci.pciDeviceId == gpu.pci_device_id
    assert pynvml.nvmlDeviceGetCudaComputeCapability(handle) == gpu.compute_capability
    processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert [(p.pid, p.usedGpuMemory) for p in processes] == [
        (p.pid, p.used_memory) for p in gpu.processes
    ] + [(p.pid, p.used_memory) for device in gpu.mig_devices for p in device.processes]
    sampled = [(p.pid, p.sm_util) for p in gpu.processes if p.sm_util is not None]
    if sampled:
        samples = pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
        assert [(s.pid, s.smUtil, s.memUtil) for s in samples] == [
            (pid, util, util * 2 // 3) for pid, util in sampled
        ]
    else:
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
    assert pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle) == []
    assert pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES) == gpu.pcie_tx
    assert pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES) == gpu.pcie_rx
    fields = pynvml.nvmlDeviceGetFieldValues(handle, NVLINK_TOTALS)
    expected = pynvml.NVML_SUCCESS if gpu.nvlinks else pynvml.NVML_ERROR_NOT_SUPPORTED
    assert [field.nvmlReturn for field in fields] == [expected, expected]
    assert_reports_mig(gpu, handle)


def assert_reports_mig(gpu: SimulatedGpu, handle: object) -> None:
    """The MIG mode and every MIG device of ``gpu``, read back through pynvml."""
    if gpu.mig is MigMode.UNSUPPORTED:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigMode(handle)
        return
    enabled = gpu.mig is MigMode.ENABLED
    assert pynvml.nvmlDeviceGetMigMode(handle) == [int(enabled)] * 2
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(handle) == (7 if enabled else 0)
    for index, device in enumerate(gpu.mig_devices):
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        assert pynvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
        assert pynvml.nvmlDeviceGetUUID(mig) == device.uuid
        assert pynvml.nvmlDeviceGetName(mig) == device.name
        assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == device.gpu_instance_id
        assert pynvml.nvmlDeviceGetComputeInstanceId(mig) == device.compute_instance_id
        memory = pynvml.nvmlDeviceGetMemoryInfo(mig)
        assert (memory.total, memory.used) == (device.memory_total, device.memory_used)
        parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        assert pynvml.nvmlDeviceGetUUID(parent) == gpu.uuid
        assert [
            (p.pid, p.gpuInstanceId, p.computeInstanceId)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(mig)
        ] == [(p.pid, device.gpu_instance_id, device.compute_instance_id) for p in device.processes]
    if enabled:
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, len(gpu.mig_devices))


def busy_gpus() -> tuple[SimulatedGpu, ...]:
    first, second = default_gpus(2)
    return (
        dataclasses.replace(
            first,
            memory_used=12 * 2**30,
            utilization_gpu=87,
            utilization_memory=41,
            temperature=64,
            power_usage=512_345,
            processes=(SimulatedProcess(4242, 8 * 2**30), SimulatedProcess(4243, 4 * 2**30)),
        ),
        dataclasses.replace(second, power_limit=350_000),
    )


class TestReporting:
    def test_reports_exactly_the_configured_gpus(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.write(busy_gpus())
        pynvml.nvmlInit()
        try:
            assert is_fake_library(pynvml.nvmlLib)
            assert pynvml.nvmlDeviceGetCount() == 2
            for index, gpu in enumerate(fake_nvml.gpus):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                assert pynvml.nvmlDeviceGetIndex(handle) == index
                assert_reports(gpu, handle)
                by_uuid = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                by_bus = pynvml.nvmlDeviceGetHandleByPciBusId(gpu.pci_bus_id)
                assert pynvml.nvmlDeviceGetUUID(by_uuid) == gpu.uuid
                assert pynvml.nvmlDeviceGetUUID(by_bus) == gpu.uuid
        finally:
            pynvml.nvmlShutdown()

    def test_system_versions(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.write(
            FakeNvmlConfig(gpus=(), driver_version="535.104.05", cuda_driver_version=12020)
        )
        pynvml.nvmlInit()
        try:
            assert pynvml.nvmlSystemGetDriverVersion() == "535.104.05"
            assert pynvml.nvmlSystemGetNVMLVersion() == "12.535.104.05"
            assert pynvml.nvmlSystemGetCudaDriverVersion() == 12020
            assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 12020
            assert pynvml.nvmlDeviceGetCount() == 0
        finally:
            pynvml.nvmlShutdown()

    @settings(
        max_examples=40,
        deadline=None,
        # The fixture only provides the library; each example writes its own config and inits.
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(config=configs())
    def test_c_parser_agrees_with_python_model(
        self, fake_nvml: FakeNvml, config: FakeNvmlConfig
    ) -> None:
        fake_nvml.write(config)
        pynvml.nvmlInit()
        try:
            assert pynvml.nvmlSystemGetDriverVersion() == config.driver_version
            assert pynvml.nvmlSystemGetCudaDriverVersion() == config.cuda_driver_version
            assert pynvml.nvmlDeviceGetCount() == len(config.gpus)
            for index, gpu in enumerate(config.gpus):
                if gpu.lost:
                    with pytest.raises(pynvml.NVMLError_GpuIsLost):
                        pynvml.nvmlDeviceGetHandleByIndex(index)
                else:
                    assert_reports(gpu, pynvml.nvmlDeviceGetHandleByIndex(index))
        finally:
            pynvml.nvmlShutdown()

    def test_process_samples_are_newer_than_the_callers_last(self, nvml: FakeNvml) -> None:
        """A sample carries the config's mtime: asking for newer ones than that finds none."""
        nvml.update_gpu(nvml.gpus[0].uuid, processes=(SimulatedProcess(7, 1, 50),))
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        (sample,) = pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
        assert (sample.pid, sample.smUtil) == (7, 50)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetProcessUtilization(handle, sample.timeStamp)

    def test_mig_is_not_supported(self, nvml: FakeNvml) -> None:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigMode(handle)

    def test_topology_one_cpu_and_no_nvlink(self, nvml: FakeNvml) -> None:
        """What NVIDIA's device plugin asks before it prefers devices (go-gpuallocator): the
        simulated GPUs share a CPU and have no NVLink, so every link is NOT_SUPPORTED."""
        first, second = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        level = pynvml.nvmlDeviceGetTopologyCommonAncestor(first, second)
        assert level == pynvml.NVML_TOPOLOGY_NODE
        for link in (0, pynvml.NVML_NVLINK_MAX_LINKS - 1):
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetNvLinkState(first, link)
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetNvLinkRemotePciInfo(first, link)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetNvLinkState(first, pynvml.NVML_NVLINK_MAX_LINKS)

    def test_pcie_throughput_counters(self, nvml: FakeNvml) -> None:
        nvml.update_gpu(nvml.gpus[0].uuid, pcie_tx=125_000, pcie_rx=2_400_000)
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES) == 125_000
        assert pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES) == (
            2_400_000
        )
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_COUNT)

    def test_nvlink_counts_grow_at_the_configured_rates(self, nvml: FakeNvml) -> None:
        """NVML's running KiB counts, per link and in total; TX and RX count over the same
        time, so their steps keep the configured ratio whatever time passed."""
        nvml.update_gpu(nvml.gpus[0].uuid, nvlinks=4, nvlink_tx=3_000_000_000, nvlink_rx=10**9)
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        first_tx, first_rx = pynvml.nvmlDeviceGetFieldValues(handle, NVLINK_TOTALS)
        fields = [*NVLINK_TOTALS, (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 3)]
        tx, rx, link = pynvml.nvmlDeviceGetFieldValues(handle, fields)
        assert [f.nvmlReturn for f in (tx, rx, link)] == [pynvml.NVML_SUCCESS] * 3
        assert tx.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        sent = tx.value.ullVal - first_tx.value.ullVal
        received = rx.value.ullVal - first_rx.value.ullVal
        assert received > 0
        assert sent // 3 in range(received - 1, received + 2)
        assert link.value.ullVal == tx.value.ullVal // 4
        assert tx.timestamp >= first_tx.timestamp > 0
        beyond = pynvml.nvmlDeviceGetFieldValues(
            handle, [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 4)]
        )
        assert beyond[0].nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT

    def test_nvlink_fields_not_supported_without_links(self, nvml: FakeNvml) -> None:
        handle = pynvml.nvmlDeviceGetHandleByIndex(1)
        fields = [*NVLINK_TOTALS, (pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, 0)]
        answers = pynvml.nvmlDeviceGetFieldValues(handle, fields)
        assert [f.nvmlReturn for f in answers] == [pynvml.NVML_ERROR_NOT_SUPPORTED] * 3

    def test_unknown_uuid_is_not_found(self, nvml: FakeNvml) -> None:
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")

    def test_unknown_bus_id_is_not_found(self, nvml: FakeNvml) -> None:
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByPciBusId("00000000:01:00.0")

    def test_index_out_of_range(self, nvml: FakeNvml) -> None:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetHandleByIndex(2)

    def test_other_temperature_sensors_are_invalid(self, nvml: FakeNvml) -> None:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU_MAX)

    def test_memory_struct_version_is_checked(self, nvml: FakeNvml) -> None:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            pynvml.nvmlDeviceGetMemoryInfo(handle, version=1)

    @pytest.mark.parametrize(
        ("code", "text"),
        [(0, "Success"), (9, "Driver Not Loaded"), (15, "GPU is lost"), (12345, "Unknown Error")],
    )
    def test_error_strings(self, nvml: FakeNvml, code: int, text: str) -> None:
        assert pynvml.nvmlErrorString(code) == text


class TestLiveChanges:
    def test_utilisation_change_is_seen_without_restart(self, nvml: FakeNvml) -> None:
        uuid = nvml.gpus[0].uuid
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        assert pynvml.nvmlDeviceGetUtilizationRates(handle).gpu == 0
        nvml.update_gpu(uuid, utilization_gpu=77, memory_used=2**30)
        assert pynvml.nvmlDeviceGetUtilizationRates(handle).gpu == 77
        assert pynvml.nvmlDeviceGetMemoryInfo(handle).used == 2**30
        nvml.update_gpu(uuid, utilization_gpu=78)
        assert pynvml.nvmlDeviceGetUtilizationRates(handle).gpu == 78

    def test_hot_plug_and_unplug(self, nvml: FakeNvml) -> None:
        first, second, third = default_gpus(3)
        old_handle = pynvml.nvmlDeviceGetHandleByUUID(second.uuid)
        nvml.write((first, second, third))
        assert pynvml.nvmlDeviceGetCount() == 3
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(2)) == third.uuid
        nvml.write((first, third))
        assert pynvml.nvmlDeviceGetCount() == 2
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID(second.uuid)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetName(old_handle)
        nvml.write((first, second))
        assert pynvml.nvmlDeviceGetUUID(old_handle) == second.uuid, "re-plugged GPU, same handle"

    def test_handles_stay_bound_to_their_gpu_when_order_changes(self, nvml: FakeNvml) -> None:
        first, second = nvml.gpus
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        nvml.write((second, first))
        assert pynvml.nvmlDeviceGetUUID(handle) == first.uuid
        assert pynvml.nvmlDeviceGetIndex(handle) == 1

    def test_broken_rewrite_keeps_the_last_good_state(
        self, nvml: FakeNvml, capfd: pytest.CaptureFixture[str]
    ) -> None:
        broken = nvml.config_path.with_suffix(".broken")
        broken.write_text("version=1\n[gpu]\nuuid=GPU-x\n")
        os.replace(broken, nvml.config_path)
        assert pynvml.nvmlDeviceGetCount() == 2
        assert "GPU GPU-x has no minor" in nvml.last_error()
        assert "fake-nvml:" in capfd.readouterr().err
        nvml.write(default_gpus(3))
        assert pynvml.nvmlDeviceGetCount() == 3
        assert nvml.last_error() == ""

    def test_concurrent_readers_see_whole_states(self, nvml: FakeNvml) -> None:
        uuid = nvml.gpus[0].uuid
        done = threading.Event()
        seen: list[tuple[int, int]] = []
        failures: list[BaseException] = []

        def read() -> None:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            while not done.is_set():
                try:
                    util = pynvml.nvmlDeviceGetUtilizationRates(handle)
                    seen.append((util.gpu, util.memory))
                    assert pynvml.nvmlDeviceGetCount() == 2
                except BaseException as error:  # reported to the main thread below
                    failures.append(error)
                    return

        readers = [threading.Thread(target=read) for _ in range(4)]
        for reader in readers:
            reader.start()
        try:
            for value in range(1, 60):
                nvml.update_gpu(uuid, utilization_gpu=value, utilization_memory=value)
        finally:
            done.set()
            for reader in readers:
                reader.join()
        assert not failures
        assert seen
        assert all(gpu == memory for gpu, memory in seen), "a reader saw half of an update"


class TestErrors:
    def test_injected_init_error(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.set_init_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
            pynvml.nvmlInit()
        assert "FAKE_NVML_INIT_ERROR=9" in fake_nvml.last_error()
        fake_nvml.set_init_error(None)
        pynvml.nvmlInit()
        assert pynvml.nvmlDeviceGetCount() == 2
        pynvml.nvmlShutdown()

    def test_missing_config_is_driver_not_loaded(
        self, fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("FAKE_NVML_CONFIG", str(fake_nvml.config_path.with_name("missing")))
        with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
            pynvml.nvmlInit()

    def test_unset_config_is_driver_not_loaded(
        self, fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("FAKE_NVML_CONFIG")
        with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
            pynvml.nvmlInit()
        assert "FAKE_NVML_CONFIG is not set" in fake_nvml.last_error()

    def test_invalid_config_fails_init_and_says_why(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.config_path.write_text("version=1\n[gpu]\nuuid=GPU-a\nminor=0\ncolour=green\n")
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlInit()
        assert fake_nvml.last_error() == f"{fake_nvml.config_path}:5: unknown GPU key colour"

    def test_lost_gpu(self, fake_nvml: FakeNvml) -> None:
        healthy, lost = fake_nvml.gpus
        fake_nvml.update_gpu(lost.uuid, lost=True)
        pynvml.nvmlInit()
        try:
            assert pynvml.nvmlDeviceGetCount() == 2, "a lost GPU is still enumerated"
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                pynvml.nvmlDeviceGetHandleByIndex(1)
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                pynvml.nvmlDeviceGetHandleByUUID(lost.uuid)
            assert pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) == healthy.name
        finally:
            pynvml.nvmlShutdown()

    def test_gpu_lost_while_in_use(self, nvml: FakeNvml) -> None:
        uuid = nvml.gpus[0].uuid
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        nvml.update_gpu(uuid, lost=True)
        for query in (
            pynvml.nvmlDeviceGetName,
            pynvml.nvmlDeviceGetMemoryInfo,
            pynvml.nvmlDeviceGetUtilizationRates,
            pynvml.nvmlDeviceGetMinorNumber,
            pynvml.nvmlDeviceGetComputeRunningProcesses,
        ):
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                query(handle)

    def test_init_is_counted(self, fake_nvml: FakeNvml) -> None:
        pynvml.nvmlInit()
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        assert pynvml.nvmlDeviceGetCount() == 2, "still initialised once"
        pynvml.nvmlShutdown()
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlDeviceGetCount()
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlShutdown()

    def test_leaving_nvml_initialised_is_cleaned_up_by_the_fixture(
        self, fake_nvml: FakeNvml
    ) -> None:
        for _ in range(3):
            pynvml.nvmlInit()
        assert pynvml.nvmlDeviceGetCount() == 2

    def test_each_test_starts_uninitialised(self, fake_nvml: FakeNvml) -> None:
        # Whatever ran before (see the leaky test above): nothing loaded in pynvml, and the C
        # library's init count at zero.
        assert pynvml.nvmlLib is None
        assert fake_nvml.library.nvmlShutdown() == pynvml.NVML_ERROR_UNINITIALIZED

    def test_new_uuid_in_running_process(self, nvml: FakeNvml) -> None:
        added = SimulatedGpu(uuid=GpuUuid("GPU-hand-made"), minor=7, name="Hand made (simulated)")
        nvml.write((*nvml.gpus, added))
        handle = pynvml.nvmlDeviceGetHandleByUUID(added.uuid)
        assert pynvml.nvmlDeviceGetName(handle) == added.name
        assert pynvml.nvmlDeviceGetPciInfo_v3(handle).busId == "00000000:08:00.0"
