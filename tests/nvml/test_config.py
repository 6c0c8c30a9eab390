"""The simulated-GPU model and its file format, without loading the library."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jupyter_gpu_hotplug._structs import GpuUuid
from jupyter_gpu_hotplug.nvml.sim import (
    H100_SXM,
    MAX_GPU_MINOR,
    MAX_NVLINKS,
    SIMULATED_SUFFIX,
    FakeNvmlConfig,
    FakeNvmlConfigError,
    GpuModel,
    MigMode,
    SimulatedGpu,
    SimulatedMigDevice,
    SimulatedProcess,
    default_gpus,
    mig_caps_minors,
    parse_config,
    read_config,
    render_config,
    write_config,
)

UUID_FORMAT = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def gpu(**changes: Any) -> SimulatedGpu:
    fields: dict[str, Any] = {"uuid": GpuUuid("GPU-test"), "minor": 0}
    fields.update(changes)
    return SimulatedGpu(**fields)


class TestDefaultGpus:
    def test_realistic_labelled_h100s(self) -> None:
        gpus = default_gpus(4)
        assert [g.minor for g in gpus] == [0, 1, 2, 3]
        for g in gpus:
            assert UUID_FORMAT.fullmatch(g.uuid)
            assert g.name == H100_SXM.name + SIMULATED_SUFFIX == "NVIDIA H100 80GB HBM3 (simulated)"
            assert g.memory_total == 81559 * 2**20
            assert g.memory_used == 0
            assert g.power_limit == 700_000
            assert 0 < g.power_usage < g.power_limit
            assert g.compute_capability == (9, 0)
            assert not g.processes
            assert not g.lost
        assert [g.pci_bus_id for g in gpus] == [
            "00000000:18:00.0",
            "00000000:2A:00.0",
            "00000000:3A:00.0",
            "00000000:5D:00.0",
        ]

    def test_identities_are_stable_and_unique(self) -> None:
        first, again = default_gpus(16), default_gpus(16)
        assert first == again
        assert len({g.uuid for g in first}) == 16
        assert len({g.pci_bus_id for g in first}) == 16
        assert first[8].pci_bus_id == "00000001:18:00.0"

    def test_nodes_get_different_uuids(self) -> None:
        a = {g.uuid for g in default_gpus(2, node="node-a")}
        b = {g.uuid for g in default_gpus(2, node="node-b")}
        assert not a & b

    def test_model_is_used(self) -> None:
        model = GpuModel(
            name="NVIDIA A100-SXM4-40GB",
            memory_total=40 * 2**30,
            power_limit=400_000,
            idle_power=50_000,
            idle_temperature=28,
            pci_device_id=0x20B010DE,
            compute_capability=(8, 0),
        )
        (only,) = default_gpus(1, model=model)
        assert only.name == "NVIDIA A100-SXM4-40GB (simulated)"
        assert (only.memory_total, only.compute_capability) == (40 * 2**30, (8, 0))

    @pytest.mark.parametrize("count", [-1, 65])
    def test_count_is_bounded(self, count: int) -> None:
        with pytest.raises(FakeNvmlConfigError):
            default_gpus(count)

    def test_zero_gpus(self) -> None:
        assert default_gpus(0) == ()


class TestValidation:
    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            pytest.param({"memory_total": 10, "memory_used": 11}, "memory_used", id="used>total"),
            pytest.param({"utilization_gpu": 101}, "utilization_gpu", id="util>100"),
            pytest.param({"minor": MAX_GPU_MINOR + 1}, "minor", id="minor-is-nvidiactl"),
            pytest.param({"minor": True}, "minor must be an int", id="bool-minor"),
            pytest.param({"name": "two\nlines"}, "one line", id="newline"),
            pytest.param({"name": " padded"}, "whitespace", id="padded"),
            pytest.param({"uuid": ""}, "non-empty", id="empty-uuid"),
            pytest.param({"name": "x" * 96}, "longer than 95 bytes", id="long-name"),
            pytest.param({"pci_bus_id": "18:00"}, "pci_bus_id", id="bus-id-format"),
            pytest.param({"pci_bus_id": "0:100:00.0"}, "out of range", id="bus-id-range"),
            pytest.param({"compute_capability": (9,)}, "compute_capability", id="cc"),
            pytest.param({"power_usage": -1}, "power_usage", id="negative"),
            pytest.param({"pcie_rx": 2**32}, "pcie_rx", id="pcie>uint"),
            pytest.param({"nvlinks": MAX_NVLINKS + 1}, "nvlinks=37 is outside", id="links>36"),
            pytest.param({"nvlink_tx": 1}, "NVLink traffic but nvlinks=0", id="traffic-no-link"),
        ],
    )
    def test_rejected(self, changes: dict[str, Any], message: str) -> None:
        with pytest.raises(FakeNvmlConfigError, match=message):
            gpu(**changes)

    def test_errors_are_value_errors(self) -> None:
        with pytest.raises(ValueError):
            gpu(temperature=201)

    @pytest.mark.parametrize(("pid", "used"), [(0, 1), (1, -1), (2**32, 1), (1, 2**64 - 1)])
    def test_process_rejected(self, pid: int, used: int) -> None:
        with pytest.raises(FakeNvmlConfigError):
            SimulatedProcess(pid, used)

    @pytest.mark.parametrize("util", [-1, 101])
    def test_process_utilisation_is_a_percentage(self, util: int) -> None:
        with pytest.raises(FakeNvmlConfigError, match="sm_util"):
            SimulatedProcess(1, 1, util)

    def test_bus_id_normalised_to_nvml_spelling(self) -> None:
        assert gpu(pci_bus_id="0:1a:3.1").pci_bus_id == "00000000:1A:03.1"
        assert gpu(pci_bus_id="1a:00.0").pci_bus_id == "00000000:1A:00.0"

    def test_bus_id_defaults_from_minor(self) -> None:
        assert gpu(minor=9).pci_bus_id == "00000000:0A:00.0"

    @pytest.mark.parametrize("attribute", ["uuid", "minor"])
    def test_config_rejects_duplicates(self, attribute: str) -> None:
        a = gpu(uuid=GpuUuid("GPU-a"), minor=0)
        b = gpu(uuid=GpuUuid("GPU-a" if attribute == "uuid" else "GPU-b"), minor=0)
        with pytest.raises(FakeNvmlConfigError, match=f"{attribute} appears twice"):
            FakeNvmlConfig(gpus=(a, b))

    def test_gpu_lookup(self) -> None:
        config = FakeNvmlConfig(gpus=default_gpus(2))
        assert config.gpu(config.gpus[1].uuid) is config.gpus[1]
        with pytest.raises(KeyError):
            config.gpu("GPU-missing")


# One line of printable text; at most 19 characters, so at most 76 bytes of UTF-8 (limits: 79+).
texts = (
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")),
        min_size=1,
        max_size=19,
    )
    .map(str.strip)
    .filter(bool)
)


@st.composite
def mig_devices(
    draw: st.DrawFn, gpu_index: int, gpu_minor: int, memory: int
) -> tuple[SimulatedMigDevice, ...]:
    """Up to three 1g/2g MIG devices (at most 7 slices) whose memory fits ``memory``."""
    count = draw(st.integers(0, 3))
    devices = []
    for gi in draw(st.lists(st.integers(0, 14), unique=True, min_size=count, max_size=count)):
        ci = draw(st.integers(0, 7))
        gi_minor, ci_minor = mig_caps_minors(gpu_minor, gi, ci)
        total = draw(st.integers(0, memory // 3))
        devices.append(
            SimulatedMigDevice(
                uuid=GpuUuid(f"MIG-{draw(texts)}-{gpu_index}-{gi}"),
                profile=draw(st.sampled_from(["1g.10gb", "2g.20gb"])),
                gpu_instance_id=gi,
                compute_instance_id=ci,
                gi_access_minor=gi_minor,
                ci_access_minor=ci_minor,
                placement_start=draw(st.integers(0, 7)),
                name=draw(st.just("") | texts),
                memory_total=total,
                memory_used=draw(st.integers(0, total)),
                processes=tuple(
                    SimulatedProcess(pid, None)
                    for pid in draw(st.lists(st.integers(1, 2**32 - 1), max_size=2))
                ),
            )
        )
    return tuple(devices)


@st.composite
def simulated_gpus(draw: st.DrawFn, index: int, minor: int) -> SimulatedGpu:
    total = draw(st.integers(0, 2**64 - 1))
    devices = draw(mig_devices(index, minor, total))
    return SimulatedGpu(
        uuid=GpuUuid(f"GPU-{draw(texts)}-{index}"),  # the index suffix keeps UUIDs unique
        minor=minor,
        name=draw(texts),
        pci_bus_id=f"{draw(st.integers(0, 2**32 - 1)):X}:{draw(st.integers(0, 255)):X}:"
        f"{draw(st.integers(0, 31)):X}.{draw(st.integers(0, 7))}",
        pci_device_id=draw(st.integers(0, 2**32 - 1)),
        memory_total=total,
        memory_used=draw(st.integers(0, total)),
        utilization_gpu=draw(st.integers(0, 100)),
        utilization_memory=draw(st.integers(0, 100)),
        temperature=draw(st.integers(0, 200)),
        power_usage=draw(st.integers(0, 2**32 - 1)),
        power_limit=draw(st.integers(0, 2**32 - 1)),
        compute_capability=(draw(st.integers(0, 99)), draw(st.integers(0, 99))),
        processes=tuple(
            SimulatedProcess(pid, used, util)
            for pid, used, util in draw(
                st.lists(
                    st.tuples(
                        st.integers(1, 2**32 - 1),
                        st.none() | st.integers(0, 2**64 - 2),
                        st.none() | st.integers(0, 100),
                    ),
                    max_size=5,
                )
            )
        ),
        lost=draw(st.booleans()),
        mig=MigMode.ENABLED if devices else draw(st.sampled_from(MigMode)),
        mig_devices=devices,
        pcie_tx=draw(st.integers(0, 2**32 - 1)),
        pcie_rx=draw(st.integers(0, 2**32 - 1)),
        **draw(nvlink_traffic()),
    )


@st.composite
def nvlink_traffic(draw: st.DrawFn) -> dict[str, int]:
    """No NVLink, or some links with any traffic."""
    links = draw(st.integers(0, MAX_NVLINKS))
    rates = st.integers(0, 2**64 - 1) if links else st.just(0)
    return {"nvlinks": links, "nvlink_tx": draw(rates), "nvlink_rx": draw(rates)}


@st.composite
def configs(draw: st.DrawFn, max_gpus: int = 4) -> FakeNvmlConfig:
    minors = draw(st.lists(st.integers(0, MAX_GPU_MINOR), unique=True, max_size=max_gpus))
    return FakeNvmlConfig(
        gpus=tuple(draw(simulated_gpus(index, minor)) for index, minor in enumerate(minors)),
        driver_version=draw(texts),
        cuda_driver_version=draw(st.integers(0, 2**31 - 1)),
    )


class TestFormat:
    @given(configs())
    def test_round_trip(self, config: FakeNvmlConfig) -> None:
        assert parse_config(render_config(config)) == config

    def test_hand_written_minimal_config_gets_defaults(self) -> None:
        config = parse_config("version=1\n[gpu]\nuuid=GPU-x\nminor=2\n")
        assert config == FakeNvmlConfig(gpus=(gpu(uuid=GpuUuid("GPU-x"), minor=2),))
        assert config.gpus[0].name == "NVIDIA GPU" + SIMULATED_SUFFIX
        assert config.gpus[0].pci_bus_id == "00000000:03:00.0"

    def test_tolerant_layout(self) -> None:
        text = (
            "# comment\r\n\r\n  version = 1  \r\ndriver_version = 535.1\n"
            "[gpu]\n uuid = GPU-x \nminor=0\nprocesses = 7:1 , 8:na\nlost=TRUE\n"
            "pci_device_id=0xabcd10de\n"
        )
        config = parse_config(text)
        assert config.driver_version == "535.1"
        (only,) = config.gpus
        assert only.uuid == "GPU-x"
        assert only.processes == (SimulatedProcess(7, 1), SimulatedProcess(8, None))
        assert only.lost
        assert only.pci_device_id == 0xABCD10DE

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            pytest.param("", r"<config>: no version=1 line", id="empty"),
            pytest.param(
                "driver_version=1\n", r"<config>:1: the first setting must be", id="first"
            ),
            pytest.param("[gpu]\n", r"<config>:1: the first setting must be", id="gpu-first"),
            pytest.param("version=2\n", r"<config>:1: unsupported format version 2", id="v2"),
            pytest.param("version=1\nversion=1\n", r":2: unknown global key version", id="twice"),
            pytest.param("version=1\nflavour=x\n", r":2: unknown global key flavour", id="global"),
            pytest.param(
                "version=1\n[gpu]\nuuid=GPU-a\nspeed=9\n",
                r":4: unknown GPU key speed",
                id="gpu-key",
            ),
            pytest.param("version=1\n[gpu]\nuuid=a\nuuid=b\n", r":4: uuid given twice", id="dup"),
            pytest.param("version=1\n[cpu]\n", r":2: unknown section \[cpu\]", id="section"),
            pytest.param("version=1\njunk\n", r":2: expected key=value", id="no-equals"),
            pytest.param(
                "version=1\n[gpu]\nminor=0\n", r":2: GPU section without uuid", id="no-uuid"
            ),
            pytest.param(
                "version=1\n[gpu]\nuuid=a\nminor=x\n", r":2: minor x: expected a whole", id="minor"
            ),
            pytest.param(
                "version=1\n[gpu]\nuuid=a\nminor=0\nprocesses=1:2,,3:4\n",
                r":2: process : expected pid:used_bytes",
                id="empty-process",
            ),
            pytest.param(
                "version=1\n[gpu]\nuuid=a\nminor=0\nprocesses=1:2:101\n",
                r":2: process 1:2:101: sm_util=101 is outside 0..100",
                id="process-util",
            ),
            pytest.param(
                "version=1\n[gpu]\nuuid=a\nminor=0\nnvlink_rx=5\n",
                r":2: GPU a has NVLink traffic but nvlinks=0",
                id="traffic-no-link",
            ),
            pytest.param(
                "version=1\n[gpu]\nuuid=a\nminor=0\npcie_tx=-1\n",
                r":2: pcie_tx -1: expected a whole number",
                id="pcie-negative",
            ),
            pytest.param(
                "version=1\n[gpu]\nuuid=a\nminor=0\nmemory_used=5\n",
                r":2: memory_used=5 is outside 0..0",
                id="used>total",
            ),
            pytest.param(
                "version=1\n[gpu]\nuuid=a\nminor=0\n[gpu]\nuuid=a\nminor=1\n",
                r"<config>: uuid appears twice: a",
                id="dup-uuid",
            ),
        ],
    )
    def test_errors_name_the_line(self, text: str, message: str) -> None:
        with pytest.raises(FakeNvmlConfigError, match=message):
            parse_config(text)


class TestFiles:
    def test_write_then_read(self, tmp_path: Path) -> None:
        path = tmp_path / "node.conf"
        config = FakeNvmlConfig(gpus=default_gpus(3), driver_version="535.104.05")
        write_config(path, config)
        assert read_config(path) == config

    def test_write_accepts_bare_gpus(self, tmp_path: Path) -> None:
        path = tmp_path / "node.conf"
        write_config(path, iter(default_gpus(1)))
        assert read_config(path) == FakeNvmlConfig(gpus=default_gpus(1))

    def test_write_replaces_atomically_and_leaves_nothing_behind(self, tmp_path: Path) -> None:
        path = tmp_path / "node.conf"
        write_config(path, default_gpus(1))
        before = path.stat().st_ino
        write_config(path, default_gpus(2))
        after = path.stat()
        assert after.st_ino != before, "an in-place write would not be atomic"
        assert stat.S_IMODE(after.st_mode) == 0o644
        assert sorted(os.listdir(tmp_path)) == ["node.conf"]

    def test_write_into_missing_directory_fails_cleanly(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError):
            write_config(tmp_path / "missing" / "node.conf", default_gpus(1))
        assert os.listdir(tmp_path) == []

    def test_read_names_the_file(self, tmp_path: Path) -> None:
        path = tmp_path / "node.conf"
        path.write_text("version=1\nbogus=1\n")
        with pytest.raises(FakeNvmlConfigError, match=re.escape(f"{path}:2: unknown global key")):
            read_config(path)
