"""``GpuMonitor`` over the fake NVML: snapshots match the simulated node, hot-plug is seen.

The fake NVML is the real ``pynvml`` loading the simulator's ``libnvidia-ml.so.1``; rewriting
its config file is the "hardware" changing. The one test that makes real device nodes
(``c 195:N``, like a hot-attach does) needs root.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from ctypes.util import find_library
from pathlib import Path

import pynvml
import pytest

from jupyter_gpu_hotplug._structs import PID_MAX_LIMIT
from jupyter_gpu_hotplug.nvml.sim import (
    FakeNvmlConfig,
    SimulatedProcess,
    default_gpus,
)
from jupyter_gpu_hotplug.nvml.state import (
    GpuIdentity,
    GpuMonitor,
    GpuProcess,
    GpuState,
    NvmlStatus,
)
from tests.fixtures.nvml import FakeNvml, add_gpu_node
from tests.fixtures.requirements import needs_root

_NVML_ERROR_UNINITIALIZED = 1
_DRIVER_NOT_LOADED = 9
_UNKNOWN = 999


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def monitor(fake_nvml: FakeNvml, dev: Path, clock: FakeClock) -> Iterator[GpuMonitor]:
    with GpuMonitor(dev_dir=dev, retry_interval=30.0, clock=clock) as gpu_monitor:
        yield gpu_monitor


def nvml_initialised(fake_nvml: FakeNvml) -> bool:
    """Whether the C library holds an initialisation (probe without changing the count)."""
    if fake_nvml.library.nvmlShutdown() == _NVML_ERROR_UNINITIALIZED:
        return False
    assert fake_nvml.library.nvmlInit_v2() == 0
    return True


def busy_node() -> FakeNvmlConfig:
    first, second = default_gpus(2)
    return FakeNvmlConfig(
        gpus=(
            dataclasses.replace(
                first,
                memory_used=12 * 2**30,
                utilization_gpu=87,
                utilization_memory=41,
                temperature=64,
                power_usage=512_345,
                pcie_tx=125_000,
                pcie_rx=2_400_000,
                processes=(
                    SimulatedProcess(os.getpid(), 10 * 2**30),
                    SimulatedProcess(PID_MAX_LIMIT, None),
                ),
            ),
            second,
        ),
        driver_version="560.35.03",
        cuda_driver_version=12060,
    )


def test_snapshot_matches_the_simulated_node(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    config = busy_node()
    fake_nvml.write(config)
    own_name = Path(f"/proc/{os.getpid()}/comm").read_text().strip()

    snapshot = monitor.snapshot()

    first, second = config.gpus
    assert snapshot.gpus == (
        GpuState(
            uuid=first.uuid,
            index=0,
            name="NVIDIA H100 80GB HBM3 (simulated)",
            minor=0,
            utilization_gpu=87,
            utilization_memory=41,
            memory_used=12 * 2**30,
            memory_total=81559 * 2**20,
            temperature=64,
            power_draw=512.345,  # NVML's milliwatts, in watts
            power_limit=700.0,
            processes=(
                GpuProcess(os.getpid(), own_name, 10 * 2**30),
                GpuProcess(PID_MAX_LIMIT, None, None),  # no process can have it: no name
            ),
            simulated=True,
            pcie_tx=125_000 * 1024,  # NVML's KB/s, in bytes/s
            pcie_rx=2_400_000 * 1024,
        ),
        GpuState(
            uuid=second.uuid,
            index=1,
            name="NVIDIA H100 80GB HBM3 (simulated)",
            minor=1,
            utilization_gpu=0,
            utilization_memory=0,
            memory_used=0,
            memory_total=81559 * 2**20,
            temperature=31,
            power_draw=69.0,
            power_limit=700.0,
            processes=(),
            simulated=True,
            pcie_tx=0,
            pcie_rx=0,
        ),
    )
    assert (snapshot.status, snapshot.message) == (NvmlStatus.OK, "2 GPUs")
    assert (snapshot.driver_version, snapshot.cuda_driver_version) == ("560.35.03", "12.6")
    assert snapshot.simulated


def test_metrics_follow_the_gpus(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    uuid = fake_nvml.gpus[0].uuid
    assert monitor.snapshot().gpus[0].utilization_gpu == 0

    fake_nvml.update_gpu(uuid, utilization_gpu=55, temperature=70, power_usage=250_500)
    state = monitor.snapshot().gpus[0]

    assert (state.utilization_gpu, state.temperature, state.power_draw) == (55, 70, 250.5)
    assert monitor.init_count == 1, "metrics need no re-initialisation"


def test_nvlink_traffic_is_a_rate_between_two_snapshots(
    fake_nvml: FakeNvml, monitor: GpuMonitor
) -> None:
    """A GPU with NVLinks: no rate at the first reading (one count), then bytes/s from
    NVML's running counts; TX and RX cover the same time, so they keep the configured ratio.
    A GPU without NVLink reads ``None``, never 0."""
    fake_nvml.update_gpu(
        fake_nvml.gpus[0].uuid, nvlinks=18, nvlink_tx=4_000_000_000, nvlink_rx=10**9
    )

    first = monitor.snapshot().gpus
    linked, unlinked = monitor.snapshot().gpus

    assert (first[0].nvlink_tx, first[0].nvlink_rx) == (None, None)
    assert linked.nvlink_tx is not None and linked.nvlink_rx is not None
    assert linked.nvlink_rx > 0
    assert abs(linked.nvlink_tx - 4 * linked.nvlink_rx) <= linked.nvlink_tx // 100
    assert (unlinked.nvlink_tx, unlinked.nvlink_rx) == (None, None)
    assert unlinked.metrics_json()["nvlink_tx"] is None


def _nvlink_counts(*readings: tuple[int, int], code: int = pynvml.NVML_SUCCESS) -> object:
    """``nvmlDeviceGetFieldValues`` answering these (microseconds, KiB) in turn, for TX and
    RX alike, each field with ``code``."""
    answers = iter(readings)

    def read(handle: object, fields: list[tuple[int, int]]) -> list[object]:
        at, kib = next(answers)
        value = pynvml.c_nvmlValue_t(ullVal=kib)
        return [
            pynvml.c_nvmlFieldValue_t(
                fieldId=field, scopeId=scope, timestamp=at, nvmlReturn=code, value=value
            )
            for field, scope in fields
        ]

    return read


@pytest.mark.parametrize(
    ("code", "lost"),
    [(pynvml.NVML_ERROR_INVALID_ARGUMENT, False), (pynvml.NVML_ERROR_GPU_IS_LOST, True)],
)
def test_an_nvlink_field_error_is_that_values_own(
    fake_nvml: FakeNvml,
    monitor: GpuMonitor,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
    lost: bool,
) -> None:
    """A field NVML will not give (a driver that does not sum the links) is ``None`` and the
    rest of the reading stands; a field saying the GPU is lost marks the GPU lost."""
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetFieldValues", _nvlink_counts((1, 1), (1, 1), code=code)
    )

    snapshot = monitor.snapshot()

    assert snapshot.status is NvmlStatus.OK
    gpu = snapshot.gpus[0]
    assert (gpu.lost, gpu.nvlink_tx, gpu.nvlink_rx) == (lost, None, None)
    assert (gpu.utilization_gpu is None) is lost


def test_nvlink_rate_arithmetic(
    fake_nvml: FakeNvml, monitor: GpuMonitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 KiB in 2 s is 102,400 bytes/s; a count that went back (a driver reload) gives no
    rate, and the next step counts from it."""
    monkeypatch.setattr(
        pynvml,
        "nvmlDeviceGetFieldValues",
        _nvlink_counts(
            *[(1_000_000, 100)] * 2,
            *[(3_000_000, 300)] * 2,
            *[(4_000_000, 5)] * 2,
            *[(5_000_000, 15)] * 2,
        ),
    )

    rates = [monitor.snapshot().gpus[0].nvlink_tx for _ in range(4)]

    assert rates == [None, 102_400, None, 10 * 1024]


def test_nothing_is_discovered_before_the_first_snapshot(fake_nvml: FakeNvml, dev: Path) -> None:
    with GpuMonitor(dev_dir=dev) as fresh:
        assert not nvml_initialised(fake_nvml)
        assert fresh.init_count == 0
        assert len(fresh.snapshot().gpus) == 2
        assert nvml_initialised(fake_nvml)
    assert not nvml_initialised(fake_nvml), "close releases NVML"


def test_snapshot_after_close_initialises_again(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    monitor.snapshot()
    monitor.close()

    assert len(monitor.snapshot().gpus) == 2
    assert monitor.init_count == 2


def test_new_device_node_reinitialises_nvml(
    fake_nvml: FakeNvml, monitor: GpuMonitor, dev: Path
) -> None:
    """The trigger needs only the name to appear (the listing is by name)."""
    monitor.snapshot()
    monitor.snapshot()
    assert monitor.init_count == 1

    (dev / "nvidia7").touch()
    monitor.snapshot()
    monitor.snapshot()
    assert monitor.init_count == 2

    (dev / "nvidia7").unlink()
    (dev / "nvidiactl").touch()  # control nodes are not GPUs
    (dev / "nvidia-uvm").touch()
    monitor.snapshot()
    assert monitor.init_count == 3
    monitor.snapshot()
    assert monitor.init_count == 3


@needs_root
def test_hot_attached_gpu_appears_and_goes(
    fake_nvml: FakeNvml, monitor: GpuMonitor, dev: Path
) -> None:
    fake_nvml.write(default_gpus(3))
    fake_nvml.set_device_filter(dev)  # NVML sees a GPU only while its node exists in dev
    _, second, third = fake_nvml.gpus

    before = monitor.snapshot()
    second_node = add_gpu_node(dev, second.minor)
    attached = monitor.snapshot()
    third_node = add_gpu_node(dev, third.minor)
    both = monitor.snapshot()
    second_node.unlink()
    one_left = monitor.snapshot()
    third_node.unlink()
    after = monitor.snapshot()

    assert (before.gpus, before.status, before.message) == (
        (),
        NvmlStatus.NO_GPU,
        "no GPU attached",
    )
    assert [(g.uuid, g.index, g.minor) for g in attached.gpus] == [(second.uuid, 0, 1)]
    assert [g.uuid for g in both.gpus] == [second.uuid, third.uuid]
    assert [(g.uuid, g.index) for g in one_left.gpus] == [(third.uuid, 0)]
    assert after.gpus == ()
    assert monitor.init_count == 5, "one initialisation per change of the device nodes"


def test_driver_not_loaded(fake_nvml: FakeNvml, monitor: GpuMonitor, clock: FakeClock) -> None:
    fake_nvml.set_init_error(_DRIVER_NOT_LOADED)

    snapshot = monitor.snapshot()

    assert snapshot.gpus == ()
    assert snapshot.status is NvmlStatus.NO_DRIVER
    assert snapshot.message == "no GPU attached: the NVIDIA driver is not loaded"
    assert (snapshot.driver_version, snapshot.simulated) == (None, False)
    assert not nvml_initialised(fake_nvml)

    fake_nvml.set_init_error(None)
    clock.now += 29
    assert monitor.snapshot().status is NvmlStatus.NO_DRIVER, "not retried before the interval"
    clock.now += 1
    assert monitor.snapshot().status is NvmlStatus.OK
    assert monitor.init_count == 1


def test_failed_init_is_retried_when_a_node_appears(
    fake_nvml: FakeNvml, monitor: GpuMonitor, dev: Path
) -> None:
    fake_nvml.set_init_error(_DRIVER_NOT_LOADED)
    monitor.snapshot()
    fake_nvml.set_init_error(None)

    (dev / "nvidia0").touch()

    assert monitor.snapshot().status is NvmlStatus.OK


def test_other_init_failure(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    fake_nvml.set_init_error(_UNKNOWN)

    snapshot = monitor.snapshot()

    assert snapshot.status is NvmlStatus.ERROR
    assert snapshot.message == "cannot read the GPUs: NVML did not start: Unknown Error"


def test_no_nvml_library(tmp_path: Path, dev: Path) -> None:
    """A container without the NVIDIA libraries: pynvml cannot load libnvidia-ml.so.1."""
    if find_library("nvidia-ml") is not None:
        pytest.skip("a real libnvidia-ml is installed on this machine")
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from jupyter_gpu_hotplug.nvml.state import GpuMonitor\n"
        "with GpuMonitor(dev_dir=Path(sys.argv[1])) as monitor:\n"
        "    print(json.dumps(monitor.snapshot().to_json()))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "FAKE_NVML"))}

    result = subprocess.run(
        [sys.executable, "-c", script, str(dev)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )

    snapshot = json.loads(result.stdout)
    assert (snapshot["gpus"], snapshot["status"]) == ([], "no_library")
    assert snapshot["message"] == (
        "no GPU attached: the NVIDIA management library (libnvidia-ml.so.1) is not installed "
        "in this container"
    )


def test_gpu_lost_and_back(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    first, second = fake_nvml.gpus
    monitor.snapshot()

    fake_nvml.update_gpu(first.uuid, lost=True)
    lost = monitor.snapshot()
    again = monitor.snapshot()
    fake_nvml.update_gpu(first.uuid, lost=False)
    back = monitor.snapshot()

    gone, fine = lost.gpus
    assert (gone.uuid, gone.index, gone.name, gone.minor, gone.lost) == (
        first.uuid,
        0,
        first.name,
        0,
        True,
    )
    assert (gone.utilization_gpu, gone.memory_total, gone.processes) == (None, None, None)
    assert (fine.uuid, fine.lost, fine.memory_total) == (second.uuid, False, second.memory_total)
    assert lost.message == "2 GPUs (1 lost)"
    assert again.gpus == lost.gpus, "still lost, still named"
    assert [(g.uuid, g.lost) for g in back.gpus] == [(first.uuid, False), (second.uuid, False)]


def test_gpu_lost_before_it_was_ever_read(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    fake_nvml.update_gpu(fake_nvml.gpus[1].uuid, lost=True)

    _, lost = monitor.snapshot().gpus

    assert (lost.uuid, lost.index, lost.lost) == (None, 1, True)


def test_gpus_added_to_the_node(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    """Without a device filter NVML's count itself changes: re-enumerated, no re-init."""
    assert len(monitor.snapshot().gpus) == 2

    fake_nvml.write(default_gpus(4))

    assert [g.minor for g in monitor.snapshot().gpus] == [0, 1, 2, 3]
    fake_nvml.write(default_gpus(1))
    assert [g.minor for g in monitor.snapshot().gpus] == [0]


def _raises(code: int) -> object:
    def read(*args: object) -> object:
        raise pynvml.NVMLError(code)

    return read


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_NO_DATA,
    ],
)
def test_unavailable_values_are_none(
    fake_nvml: FakeNvml, monitor: GpuMonitor, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """What real GPUs answer for sensors they lack; the fake offers every value."""
    for read in (
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetFieldValues",
    ):
        monkeypatch.setattr(pynvml, read, _raises(code))

    state = monitor.snapshot().gpus[0]

    assert (state.power_draw, state.power_limit, state.temperature, state.processes) == (
        None,
        None,
        None,
        None,
    )
    assert (state.pcie_tx, state.pcie_rx, state.nvlink_tx, state.nvlink_rx) == (None,) * 4
    assert state.memory_total == fake_nvml.gpus[0].memory_total
    assert state.utilization_gpu == 0


def test_nvml_failing_mid_read(
    fake_nvml: FakeNvml, monitor: GpuMonitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor.snapshot()
    with monkeypatch.context() as patch:
        patch.setattr(pynvml, "nvmlDeviceGetTemperature", _raises(pynvml.NVML_ERROR_UNKNOWN))
        broken = monitor.snapshot()

    recovered = monitor.snapshot()

    assert (broken.gpus, broken.status) == ((), NvmlStatus.ERROR)
    assert broken.message == "cannot read the GPUs: NVML failed: Unknown Error"
    assert len(recovered.gpus) == 2
    assert monitor.init_count == 2, "re-initialised at once, without waiting for the interval"


def test_process_names_come_from_proc(fake_nvml: FakeNvml, dev: Path, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, comm in ((101, "python3\n"), (102, None)):
        (proc / str(pid)).mkdir(parents=True)
        if comm is not None:
            (proc / str(pid) / "comm").write_text(comm)
    gpu = dataclasses.replace(
        fake_nvml.gpus[0],
        processes=(SimulatedProcess(101, 2**20), SimulatedProcess(102, None)),
    )
    fake_nvml.write([gpu])

    with GpuMonitor(dev_dir=dev, proc_dir=proc) as monitor:
        processes = monitor.snapshot().gpus[0].processes

    assert processes == (GpuProcess(101, "python3", 2**20), GpuProcess(102, None, None))


def test_process_utilisation_comes_from_nvml_samples(
    fake_nvml: FakeNvml, monitor: GpuMonitor
) -> None:
    """``nvmlDeviceGetProcessUtilization``: a process with a sample gets its SM share, one
    without (or a GPU with no samples at all: NOT_FOUND) gets ``None``."""
    first, second = fake_nvml.gpus[:2]
    fake_nvml.update_gpu(
        first.uuid,
        processes=(SimulatedProcess(101, 2**20, 40), SimulatedProcess(102, 2**21)),
    )
    fake_nvml.update_gpu(second.uuid, processes=(SimulatedProcess(103, 2**22),))

    gpus = monitor.snapshot().gpus

    def usage(gpu: GpuState) -> list[tuple[int, int | None, int | None]]:
        return [(p.pid, p.used_memory, p.sm_util) for p in gpu.processes or ()]

    assert usage(gpus[0]) == [(101, 2**20, 40), (102, 2**21, None)]
    assert usage(gpus[1]) == [(103, 2**22, None)]


def test_snapshots_from_many_threads(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    uuid = fake_nvml.gpus[0].uuid
    seen: list[int | None] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def take() -> None:
        start.wait()
        try:
            for _ in range(50):
                snapshot = monitor.snapshot()
                assert snapshot.status is NvmlStatus.OK
                seen.append(snapshot.gpus[0].utilization_gpu)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=take) for _ in range(3)]
    for thread in threads:
        thread.start()
    start.wait()
    for value in range(0, 100, 5):
        fake_nvml.update_gpu(uuid, utilization_gpu=value)
    for thread in threads:
        thread.join()

    assert errors == []
    assert len(seen) == 150
    assert set(seen) <= set(range(0, 100, 5))
    assert monitor.init_count == 1


def test_to_json(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    fake_nvml.write(busy_node())

    data = monitor.snapshot().to_json()

    assert json.loads(json.dumps(data)) == data
    assert data["status"] == "ok"
    assert data["gpus"][0]["power_draw"] == 512.345
    processes = data["gpus"][0]["processes"]
    assert processes is not None
    assert processes[1] == {
        "pid": PID_MAX_LIMIT,
        "name": None,
        "used_memory": None,
        "sm_util": None,
    }
    assert data["gpus"][1]["uuid"] == fake_nvml.gpus[1].uuid


# --- the lighter reads: roster() and processes(minor) ----------------------------------------

_METRIC_READS = (
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetFieldValues",
)


def test_roster_reads_identity_and_no_metric(
    fake_nvml: FakeNvml, monitor: GpuMonitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvml.write(busy_node())
    for read in _METRIC_READS:  # a snapshot would fail with these (NVML broken)
        monkeypatch.setattr(pynvml, read, _raises(pynvml.NVML_ERROR_UNKNOWN))

    roster = monitor.roster()

    first, second = busy_node().gpus
    assert roster.gpus == (
        GpuIdentity(first.uuid, 0, first.name, 0, first.memory_total, simulated=True),
        GpuIdentity(second.uuid, 1, second.name, 1, second.memory_total, simulated=True),
    )
    assert (roster.status, roster.message, roster.simulated) == (NvmlStatus.OK, "2 GPUs", True)
    assert monitor.init_count == 1


def test_roster_follows_the_node_and_lost_gpus(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    first, second = fake_nvml.gpus
    assert [g.uuid for g in monitor.roster().gpus] == [first.uuid, second.uuid]

    fake_nvml.update_gpu(first.uuid, lost=True)
    lost = monitor.roster()
    fake_nvml.update_gpu(first.uuid, lost=False)
    back = monitor.roster()
    fake_nvml.write(default_gpus(3))
    grown = monitor.roster()

    gone, fine = lost.gpus
    assert (gone.uuid, gone.name, gone.minor, gone.lost, gone.memory_total) == (
        first.uuid,
        first.name,
        0,
        True,
        None,
    )
    assert (fine.uuid, fine.lost) == (second.uuid, False)
    assert lost.message == "2 GPUs (1 lost)"
    assert [(g.uuid, g.lost) for g in back.gpus] == [(first.uuid, False), (second.uuid, False)]
    assert [g.minor for g in grown.gpus] == [0, 1, 2]
    assert monitor.snapshot().gpus[2].minor == 2, "snapshots share the enumeration"


def test_roster_when_nvml_cannot_be_used(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    fake_nvml.set_init_error(_DRIVER_NOT_LOADED)

    roster = monitor.roster()

    assert (roster.gpus, roster.status, roster.simulated) == ((), NvmlStatus.NO_DRIVER, False)
    assert roster.message == "no GPU attached: the NVIDIA driver is not loaded"
    assert monitor.processes(0) is None


def test_roster_after_nvml_fails_mid_read(
    fake_nvml: FakeNvml, monitor: GpuMonitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor.roster()
    with monkeypatch.context() as patch:
        patch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", _raises(pynvml.NVML_ERROR_UNKNOWN))
        broken = monitor.roster()

    assert (broken.gpus, broken.status) == ((), NvmlStatus.ERROR)
    assert len(monitor.roster().gpus) == 2
    assert monitor.init_count == 2, "re-initialised at once"


def test_processes_of_one_gpu(fake_nvml: FakeNvml, monitor: GpuMonitor) -> None:
    first, second = fake_nvml.gpus
    fake_nvml.update_gpu(second.uuid, processes=(SimulatedProcess(os.getpid(), 2**30),))
    own_name = Path(f"/proc/{os.getpid()}/comm").read_text().strip()

    assert monitor.processes(second.minor) == (GpuProcess(os.getpid(), own_name, 2**30),)
    assert monitor.processes(first.minor) == ()
    assert monitor.processes(77) is None, "no GPU with that minor"
    fake_nvml.update_gpu(second.uuid, lost=True)
    assert monitor.processes(second.minor) is None
    assert monitor.roster().gpus[1].lost
