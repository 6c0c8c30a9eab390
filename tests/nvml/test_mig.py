"""Simulated MIG: the model, its text in both parsers, and what the unmodified ``pynvml`` reads.

A MIG device is a GPU instance with one compute instance on a GPU in MIG mode. Real NVML lists
it under its GPU (``nvmlDeviceGetMigDeviceHandleByIndex``), gives it a ``MIG-`` UUID, its slice's
memory and processes, answers ``NOT_SUPPORTED`` for whole-GPU metrics, and describes its GPU and
compute instance; inside a container it is visible only with access to both ``nvidia-caps``
nodes. These tests hold the fake to each of those facts.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from jupyter_gpu_hotplug._structs import GpuUuid
from jupyter_gpu_hotplug.nvml.sim import (
    FakeNvmlConfig,
    FakeNvmlConfigError,
    MigMode,
    SimulatedGpu,
    SimulatedMigDevice,
    SimulatedProcess,
    default_gpus,
    mig_caps_minors,
    parse_config,
    render_config,
    render_mig_minors,
    with_mig_devices,
)
from jupyter_gpu_hotplug.nvml.state import GpuMonitor, MigSlice
from tests.fixtures.nvml import FakeNvml, add_gpu_node
from tests.fixtures.requirements import needs_root


def two_slices() -> FakeNvmlConfig:
    """GPU 0 in MIG mode with two 1g.10gb devices; GPU 1 a whole GPU."""
    first, second = default_gpus(2)
    return FakeNvmlConfig(gpus=(with_mig_devices(first, ["1g.10gb", "1g.10gb"]), second))


@pytest.fixture
def mig_nvml(fake_nvml: FakeNvml) -> Iterator[FakeNvml]:
    """``fake_nvml`` with ``two_slices()``, initialised for the test."""
    fake_nvml.write(two_slices())
    pynvml.nvmlInit()
    yield fake_nvml
    pynvml.nvmlShutdown()


def slice_handles(gpu_index: int = 0) -> list[Any]:
    """The MIG device handles of a GPU, walking 0..max-1 as NVIDIA's own tools do."""
    parent = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
    handles = []
    for index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(parent)):
        try:
            handles.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index))
        except pynvml.NVMLError_NotFound:
            continue
    return handles


class TestModel:
    def test_caps_minors_follow_the_driver_layout(self) -> None:
        # config 1, monitor 2, gpu0/gi0/access 3, gpu0/gi0/ci0/access 4 (NVIDIA's own tests).
        assert mig_caps_minors(0, 0, 0) == (3, 4)
        assert mig_caps_minors(0, 0, 7) == (3, 11)
        assert mig_caps_minors(0, 1, 0) == (12, 13)
        assert mig_caps_minors(1, 0, 0) == (3 + 15 * 9, 4 + 15 * 9)

    def test_with_mig_devices(self) -> None:
        gpu = two_slices().gpus[0]
        assert gpu.mig is MigMode.ENABLED
        first, second = gpu.mig_devices
        assert [d.gpu_instance_id for d in gpu.mig_devices] == [1, 2]
        assert (first.gi_access_minor, first.ci_access_minor) == mig_caps_minors(0, 1, 0)
        assert (second.gi_access_minor, second.ci_access_minor) == mig_caps_minors(0, 2, 0)
        assert first.uuid.startswith("MIG-") and first.uuid != second.uuid
        assert first.name == "NVIDIA H100 80GB HBM3 MIG 1g.10gb (simulated)"
        assert first.memory_total == 10 * 10**9
        assert (first.placement_start, second.placement_start) == (0, 1)
        assert with_mig_devices(default_gpus(1)[0], ["1g.10gb"]).mig_devices[0].uuid == (
            with_mig_devices(default_gpus(1)[0], ["1g.10gb"]).mig_devices[0].uuid
        ), "MIG UUIDs are stable"

    def test_default_name_is_labelled(self) -> None:
        device = SimulatedMigDevice(
            uuid=GpuUuid("MIG-x"), profile="2g.20gb", gpu_instance_id=3, gi_access_minor=5,
            ci_access_minor=6,
        )  # fmt: skip
        assert device.name == "NVIDIA MIG 2g.20gb (simulated)"
        assert device.slices == 2

    def test_mig_minors_file_lists_every_instance_of_mig_capable_gpus(self) -> None:
        config = two_slices()
        lines = render_mig_minors(config).splitlines()
        assert lines[:4] == ["config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4"]
        assert len(lines) == 2 + 15 * 9, "one MIG-capable GPU: 15 GIs with 8 CIs each"
        device = config.gpus[0].mig_devices[1]
        assert f"gpu0/gi2/access {device.gi_access_minor}" in lines
        assert f"gpu0/gi2/ci0/access {device.ci_access_minor}" in lines
        assert not any(line.startswith("gpu1/") for line in lines), "GPU 1 cannot do MIG"

    def test_round_trip(self) -> None:
        config = two_slices()
        assert parse_config(render_config(config)) == config


def mig(**changes: object) -> SimulatedMigDevice:
    fields: dict[str, object] = {
        "uuid": "MIG-a", "profile": "1g.10gb", "gpu_instance_id": 1, "gi_access_minor": 12,
        "ci_access_minor": 13,
    }  # fmt: skip
    fields.update(changes)
    return SimulatedMigDevice(**fields)  # type: ignore[arg-type]


def gpu_with(*devices: SimulatedMigDevice, **changes: object) -> SimulatedGpu:
    fields: dict[str, object] = {
        "uuid": "GPU-a", "minor": 0, "memory_total": 80 * 10**9, "mig": MigMode.ENABLED,
        "mig_devices": devices,
    }  # fmt: skip
    fields.update(changes)
    return SimulatedGpu(**fields)  # type: ignore[arg-type]


class TestValidation:
    @pytest.mark.parametrize(
        ("build", "message"),
        [
            pytest.param(lambda: mig(uuid="GPU-a"), "must start with MIG-", id="uuid-prefix"),
            pytest.param(lambda: mig(profile="5g.50gb"), "slices one of", id="profile-slices"),
            pytest.param(lambda: mig(profile="1g"), "expected <slices>g", id="profile-form"),
            pytest.param(lambda: mig(gpu_instance_id=15), "gpu_instance_id", id="gi-id"),
            pytest.param(lambda: mig(compute_instance_id=8), "compute_instance_id", id="ci-id"),
            pytest.param(lambda: mig(ci_access_minor=12), "minors are equal", id="same-minor"),
            pytest.param(lambda: mig(memory_used=1), "memory_used", id="used>total"),
            pytest.param(
                lambda: gpu_with(mig(), mig=MigMode.DISABLED), "mig=disabled", id="mode-off"
            ),
            pytest.param(
                lambda: gpu_with(mig(), mig(uuid="MIG-b", gi_access_minor=1, ci_access_minor=2)),
                "gpu_instance_id appears twice",
                id="gi-twice",
            ),
            pytest.param(
                lambda: gpu_with(mig(profile="7g.80gb"), mig(uuid="MIG-b", gpu_instance_id=2)),
                "more than 7 slices",
                id="slices",
            ),
            pytest.param(
                lambda: gpu_with(mig(memory_total=2), memory_total=1),
                "more than its memory",
                id="memory",
            ),
            pytest.param(
                lambda: gpu_with(
                    mig(),
                    mig(uuid="MIG-b", gpu_instance_id=2, profile="1g.20gb", gi_access_minor=1),
                ),
                "same slice count",
                id="profiles",
            ),
            pytest.param(
                lambda: FakeNvmlConfig(
                    gpus=(gpu_with(mig()), gpu_with(mig(), uuid="GPU-b", minor=1))
                ),
                "uuid appears twice: MIG-a",
                id="mig-uuid-twice",
            ),
            pytest.param(
                lambda: FakeNvmlConfig(
                    gpus=(gpu_with(mig()), gpu_with(mig(uuid="MIG-b"), uuid="GPU-b", minor=1))
                ),
                "nvidia-caps minor appears twice",
                id="caps-minor-twice",
            ),
        ],
    )
    def test_rejected(self, build: object, message: str) -> None:
        assert callable(build)
        with pytest.raises(FakeNvmlConfigError, match=message):
            build()


# Hand-written files that both parsers must refuse, with words both use.
BAD_FILES = [
    pytest.param("[mig]\nuuid=MIG-a\n", "must follow the [gpu]", id="orphan"),
    pytest.param("[gpu]\nuuid=GPU-a\nminor=0\nmig=maybe\n", "mig maybe", id="mode"),
    pytest.param(
        "[gpu]\nuuid=GPU-a\nminor=0\nmig=enabled\n[mig]\nuuid=MIG-a\nprofile=1g.10gb\n"
        "gpu_instance_id=1\nci_access_minor=4\n",
        "MIG section without gi_access_minor",
        id="required",
    ),
    pytest.param(
        "[gpu]\nuuid=GPU-a\nminor=0\nmig=enabled\n[mig]\nuuid=MIG-a\ncolour=red\n",
        "unknown MIG key colour",
        id="unknown-key",
    ),
    pytest.param(
        "[gpu]\nuuid=GPU-a\nminor=0\n[mig]\nuuid=MIG-a\nprofile=1g.10gb\ngpu_instance_id=1\n"
        "gi_access_minor=3\nci_access_minor=4\n",
        "has MIG devices but mig=unsupported",
        id="not-enabled",
    ),
    pytest.param(
        "[gpu]\nuuid=GPU-a\nminor=0\nmig=enabled\n[mig]\nuuid=MIG-a\nprofile=3g.0gb\n"
        "gpu_instance_id=1\ngi_access_minor=3\nci_access_minor=4\n",
        "expected <slices>g.<memory>gb with slices one of",
        id="profile",
    ),
]


@pytest.mark.parametrize(("body", "message"), BAD_FILES)
def test_python_parser_refuses(body: str, message: str) -> None:
    with pytest.raises(FakeNvmlConfigError, match=message.replace("[", r"\[")):
        parse_config("version=1\n" + body)


@pytest.mark.parametrize(("body", "message"), BAD_FILES)
def test_c_parser_refuses(fake_nvml: FakeNvml, body: str, message: str) -> None:
    fake_nvml.config_path.write_text("version=1\n" + body)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    assert message in fake_nvml.last_error()


class TestPynvml:
    def test_modes_and_counts(self, mig_nvml: FakeNvml) -> None:
        mig_gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        whole = pynvml.nvmlDeviceGetHandleByIndex(1)
        assert pynvml.nvmlDeviceGetCount() == 2, "MIG devices are not counted as GPUs"
        assert pynvml.nvmlDeviceGetMigMode(mig_gpu) == [1, 1]
        assert pynvml.nvmlDeviceGetMaxMigDeviceCount(mig_gpu) == 7
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigMode(whole)
        assert pynvml.nvmlDeviceGetMaxMigDeviceCount(whole) == 0
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(whole, 0)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(mig_gpu, 7)
        assert pynvml.nvmlDeviceIsMigDeviceHandle(mig_gpu).value == 0

    def test_disabled_mode(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.write([dataclasses.replace(default_gpus(1)[0], mig=MigMode.DISABLED)])
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            assert pynvml.nvmlDeviceGetMigMode(handle) == [0, 0]
            assert slice_handles() == []
        finally:
            pynvml.nvmlShutdown()

    def test_slices(self, mig_nvml: FakeNvml) -> None:
        gpu = mig_nvml.gpus[0]
        handles = slice_handles()
        assert [pynvml.nvmlDeviceGetUUID(h) for h in handles] == [d.uuid for d in gpu.mig_devices]
        for handle, device in zip(handles, gpu.mig_devices, strict=True):
            by_uuid = pynvml.nvmlDeviceGetHandleByUUID(device.uuid)
            assert ctypes.cast(by_uuid, ctypes.c_void_p).value == (
                ctypes.cast(handle, ctypes.c_void_p).value
            )
            for whole_gpu_query in (
                pynvml.nvmlDeviceGetUtilizationRates,
                pynvml.nvmlDeviceGetMinorNumber,
                pynvml.nvmlDeviceGetPowerUsage,
                pynvml.nvmlDeviceGetIndex,
                pynvml.nvmlDeviceGetMaxMigDeviceCount,
            ):
                with pytest.raises(pynvml.NVMLError_NotSupported):
                    whole_gpu_query(handle)
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetGpuInstanceId(pynvml.nvmlDeviceGetHandleByIndex(1))
            with pytest.raises(pynvml.NVMLError_InvalidArgument):
                pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
                    pynvml.nvmlDeviceGetHandleByIndex(1)
                )

    def test_instances(self, mig_nvml: FakeNvml) -> None:
        parent = pynvml.nvmlDeviceGetHandleByIndex(0)
        device = mig_nvml.gpus[0].mig_devices[1]
        instance = pynvml.nvmlDeviceGetGpuInstanceById(parent, device.gpu_instance_id)
        info = pynvml.nvmlGpuInstanceGetInfo(instance)
        assert pynvml.nvmlDeviceGetUUID(info.device) == mig_nvml.gpus[0].uuid
        assert (info.id, info.profileId) == (device.gpu_instance_id, 19)
        assert (info.placement.start, info.placement.size) == (1, 1)
        compute = pynvml.nvmlGpuInstanceGetComputeInstanceById(instance, 0)
        compute_info = pynvml.nvmlComputeInstanceGetInfo(compute)
        assert (compute_info.id, compute_info.profileId) == (0, 0)
        assert pynvml.nvmlDeviceGetUUID(compute_info.device) == mig_nvml.gpus[0].uuid
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlGpuInstanceGetComputeInstanceById(instance, 1)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetGpuInstanceById(parent, 9)
        profile = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
            parent, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
        )
        assert (profile.id, profile.name, profile.sliceCount) == (19, "MIG 1g.10gb", 1)
        assert profile.memorySizeMB == device.memory_total >> 20
        v1 = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
            parent, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, version=1
        )
        assert (v1.id, v1.instanceCount) == (19, 7)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
                parent, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE
            )
        instances = (pynvml.c_nvmlGpuInstance_t * 7)()
        count = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstances(parent, 19, instances, ctypes.byref(count))
        assert count.value == 2
        assert sorted(pynvml.nvmlGpuInstanceGetInfo(instances[i]).id for i in range(2)) == [1, 2]

    def test_attributes_and_compute_profiles_name_the_slice_as_nvidia_plugin_does(
        self, mig_nvml: FakeNvml
    ) -> None:
        """NVIDIA's k8s-device-plugin (go-nvlib) names a mixed-strategy resource from these: the
        slice's attributes and the one compute instance profile its GPU instance offers."""
        parent = pynvml.nvmlDeviceGetHandleByIndex(0)
        device = mig_nvml.gpus[0].mig_devices[0]
        (handle, _) = slice_handles()
        attributes = pynvml.nvmlDeviceGetAttributes(handle)
        assert (attributes.gpuInstanceSliceCount, attributes.computeInstanceSliceCount) == (1, 1)
        assert attributes.memorySizeMB == device.memory_total >> 20
        assert pynvml.nvmlDeviceGetAttributes(parent).gpuInstanceSliceCount == 7
        instance = pynvml.nvmlDeviceGetGpuInstanceById(parent, device.gpu_instance_id)
        one_slice = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE
        shared = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        for version in (1, 2):
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                instance, one_slice, shared, version=version
            )
            assert (info.id, info.sliceCount, info.instanceCount) == (one_slice, 1, 1)
        compute = pynvml.nvmlGpuInstanceGetComputeInstanceById(instance, 0)
        assert pynvml.nvmlComputeInstanceGetInfo(compute).profileId == one_slice
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                instance, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, shared
            )
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(instance, one_slice, 1)
        # go-nvlib's memory rounding (eighths of the GPU, in whole GB): "1g.10gb" on 80 GB.
        total = pynvml.nvmlDeviceGetMemoryInfo(parent).total
        eighths = -(-attributes.memorySizeMB * 2**20 * 8 // total)
        assert round(eighths / 8 * -(-total // 2**30)) == 10

    def test_processes_are_listed_per_slice_and_on_the_gpu(self, fake_nvml: FakeNvml) -> None:
        config = two_slices()
        gpu = config.gpus[0]
        first, second = gpu.mig_devices
        busy = dataclasses.replace(
            gpu,
            mig_devices=(
                dataclasses.replace(first, processes=(SimulatedProcess(11, 2**30),)),
                dataclasses.replace(second, processes=(SimulatedProcess(22, None),)),
            ),
        )
        fake_nvml.write(dataclasses.replace(config, gpus=(busy, config.gpus[1])))
        pynvml.nvmlInit()
        try:
            parent = pynvml.nvmlDeviceGetHandleByIndex(0)
            listed = pynvml.nvmlDeviceGetComputeRunningProcesses(parent)
            assert [(p.pid, p.gpuInstanceId) for p in listed] == [(11, 1), (22, 2)]
            one, two = slice_handles()
            assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(one)] == [11]
            assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(two)] == [22]
        finally:
            pynvml.nvmlShutdown()

    def test_slices_follow_config_rewrites(self, mig_nvml: FakeNvml) -> None:
        gpu = mig_nvml.gpus[0]
        kept, removed = slice_handles()
        mig_nvml.write(
            [dataclasses.replace(gpu, mig_devices=gpu.mig_devices[:1]), mig_nvml.gpus[1]]
        )
        assert [pynvml.nvmlDeviceGetUUID(h) for h in slice_handles()] == [gpu.mig_devices[0].uuid]
        assert pynvml.nvmlDeviceGetUUID(kept) == gpu.mig_devices[0].uuid
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetUUID(removed)
        mig_nvml.write([dataclasses.replace(gpu, lost=True), mig_nvml.gpus[1]])
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetMemoryInfo(kept)


def add_caps_node(dev: Path, minor: int, *, major: int = 509) -> None:
    """``dev/nvidia-caps/nvidia-cap<minor>``, as a MIG attach makes it (the major does not
    matter to the fake, which looks only for a character device)."""
    caps = dev / "nvidia-caps"
    caps.mkdir(exist_ok=True)
    os.mknod(caps / f"nvidia-cap{minor}", 0o600 | stat.S_IFCHR, os.makedev(major, minor))


@needs_root
def test_container_sees_only_slices_with_both_caps_nodes(fake_nvml: FakeNvml, dev: Path) -> None:
    fake_nvml.write(two_slices())
    fake_nvml.set_device_filter(dev)
    first, second = fake_nvml.gpus[0].mig_devices
    add_gpu_node(dev, 0)
    add_caps_node(dev, second.gi_access_minor)
    add_caps_node(dev, second.ci_access_minor)
    add_caps_node(dev, first.gi_access_minor)  # the GI alone is not enough
    pynvml.nvmlInit()
    try:
        assert [pynvml.nvmlDeviceGetUUID(h) for h in slice_handles()] == [second.uuid]
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID(first.uuid)
        parent = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetGpuInstanceById(parent, first.gpu_instance_id)
        add_caps_node(dev, first.ci_access_minor)
        assert len(slice_handles()) == 2, "re-evaluated on every lookup"
        (dev / "nvidia0").unlink()
        assert pynvml.nvmlDeviceGetCount() == 0
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID(second.uuid)
    finally:
        pynvml.nvmlShutdown()


# --- GpuMonitor: slices shown as slices --------------------------------------------------------


def test_snapshot_shows_slices_after_their_gpu(fake_nvml: FakeNvml, dev: Path) -> None:
    config = two_slices()
    gpu = config.gpus[0]
    first, second = gpu.mig_devices
    busy_first = dataclasses.replace(
        first, memory_used=2**30, processes=(SimulatedProcess(os.getpid(), 2**30),)
    )
    fake_nvml.write(
        dataclasses.replace(
            config,
            gpus=(dataclasses.replace(gpu, mig_devices=(busy_first, second)), config.gpus[1]),
        )
    )
    with GpuMonitor(dev_dir=dev) as monitor:
        snapshot = monitor.snapshot()
        roster = monitor.roster()
        parent_processes = monitor.processes(gpu.minor)

    assert snapshot.message == "2 GPUs, 2 MIG slices"
    whole, one, two, other = snapshot.gpus
    assert (whole.uuid, whole.mig, other.uuid, other.mig) == (
        gpu.uuid,
        None,
        config.gpus[1].uuid,
        None,
    )
    assert one.mig == MigSlice(
        parent_uuid=gpu.uuid, profile="1g.10gb", gpu_instance_id=1, compute_instance_id=0
    )
    assert (two.uuid, two.mig and two.mig.gpu_instance_id) == (second.uuid, 2)
    assert (one.uuid, one.name, one.minor, one.index) == (first.uuid, first.name, gpu.minor, 0)
    assert (one.memory_total, one.memory_used) == (first.memory_total, 2**30)
    assert (one.utilization_gpu, one.temperature, one.power_draw) == (None, None, None)
    assert one.processes is not None and [p.pid for p in one.processes] == [os.getpid()]
    assert two.processes == ()
    assert one.to_json()["mig"] == {
        "parent_uuid": gpu.uuid,
        "profile": "1g.10gb",
        "gpu_instance_id": 1,
        "compute_instance_id": 0,
    }
    assert whole.to_json()["mig"] is None
    assert [g.uuid for g in roster.gpus] == [gpu.uuid, config.gpus[1].uuid], "whole GPUs only"
    assert parent_processes is not None and [p.pid for p in parent_processes] == [os.getpid()]


@needs_root
def test_a_slice_attached_later_appears(fake_nvml: FakeNvml, dev: Path) -> None:
    """The container view: the kernel sees its GPU and exactly the slices it has caps nodes
    for; a slice attached while the monitor runs appears on the next snapshot."""
    fake_nvml.write(two_slices())
    fake_nvml.set_device_filter(dev)
    first, second = fake_nvml.gpus[0].mig_devices
    add_gpu_node(dev, 0)
    add_caps_node(dev, first.gi_access_minor)
    add_caps_node(dev, first.ci_access_minor)
    with GpuMonitor(dev_dir=dev) as monitor:
        before = monitor.snapshot()
        add_caps_node(dev, second.gi_access_minor)
        add_caps_node(dev, second.ci_access_minor)
        after = monitor.snapshot()
        assert monitor.init_count == 2, "a new caps node re-initialises NVML"

    assert [g.uuid for g in before.gpus] == [fake_nvml.gpus[0].uuid, first.uuid]
    assert before.message == "1 GPU, 1 MIG slice"
    assert [g.uuid for g in after.gpus] == [fake_nvml.gpus[0].uuid, first.uuid, second.uuid]


def test_roster_with_slices_for_the_agent(fake_nvml: FakeNvml, dev: Path) -> None:
    config = two_slices()
    gpu, whole = config.gpus
    fake_nvml.write(config)
    with GpuMonitor(dev_dir=dev) as monitor:
        plain = monitor.roster()
        roster = monitor.roster(slices=True)

    assert [(g.uuid, g.mig_enabled) for g in plain.gpus] == [(gpu.uuid, True), (whole.uuid, False)]
    assert [g.uuid for g in roster.gpus] == [
        gpu.uuid,
        *(d.uuid for d in gpu.mig_devices),
        whole.uuid,
    ]
    first = roster.gpus[1]
    assert (first.minor, first.memory_total, first.mig_enabled) == (gpu.minor, 10**10, False)
    assert first.mig == MigSlice(gpu.uuid, "1g.10gb", 1, 0)
    assert roster.message == "2 GPUs, 2 MIG slices"
