"""The simulation's tools for a kernel: a SIMULATED ``nvidia-smi`` and the load helper.

``nvidia-smi`` runs as a child process with the fake NVML, as in a simulated kernel, and must
show exactly what NVML shows that process (a container's view: its own GPUs, numbered from 0)
and say it is simulated. The load helper must hold a GPU's node in a way the agent's scan of
open device nodes (``linux.busy``, what a detach and the simulation ask) counts as "in use",
although no driver answers an ``open``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jupyter_gpu_hotplug.linux.busy import holders_by_device
from jupyter_gpu_hotplug.linux.devrules import CharDevice
from jupyter_gpu_hotplug.nvml.sim.load import gpu_nodes
from jupyter_gpu_hotplug.nvml.sim.smi import BANNER, write_command
from tests.fixtures.nvml import FakeNvmlNode, add_gpu_node
from tests.fixtures.requirements import needs_root


def _smi(node: FakeNvmlNode, tmp_path: Path, *args: str, dev: Path | None = None) -> str:
    command = write_command(tmp_path / "bin")
    done = subprocess.run(
        [str(command), *args],
        env=node.environ(device_filter=dev),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout


def test_nvidia_smi_says_simulated_and_shows_the_gpus(
    fake_nvml_node: FakeNvmlNode, tmp_path: Path
) -> None:
    node = fake_nvml_node
    node.update_gpu(node.gpus[1].uuid, utilization_gpu=42, memory_used=2 * 1024**3)

    table = _smi(node, tmp_path)
    listed = _smi(node, tmp_path, "-L")

    assert table.splitlines()[0] == BANNER
    assert "NVIDIA-SMI (SIMULATED)" in table
    rows = [line for line in table.splitlines() if "MiB /" in line]
    assert [("42%" in row, "2048MiB /" in row) for row in rows] == [(False, False), (True, True)]
    assert listed.splitlines()[1:] == [
        f"GPU {i}: {gpu.name} (UUID: {gpu.uuid})" for i, gpu in enumerate(node.gpus)
    ]


@needs_root
def test_nvidia_smi_in_a_container_view_shows_its_own_gpu_as_0(
    fake_nvml_node: FakeNvmlNode, tmp_path: Path, dev: Path
) -> None:
    second = fake_nvml_node.gpus[1]
    add_gpu_node(dev, second.minor)

    listed = _smi(fake_nvml_node, tmp_path, "-L", dev=dev)

    assert listed.splitlines()[1:] == [f"GPU 0: {second.name} (UUID: {second.uuid})"]


def test_nvidia_smi_refuses_what_it_does_not_simulate(
    fake_nvml_node: FakeNvmlNode, tmp_path: Path
) -> None:
    command = write_command(tmp_path / "bin")
    done = subprocess.run(
        [str(command), "--query-gpu=name"],
        env=fake_nvml_node.environ(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "only 'nvidia-smi' and 'nvidia-smi -L' are simulated" in done.stderr


@needs_root
def test_the_load_helper_holds_the_node_as_the_busy_scan_sees_it(dev: Path) -> None:
    node = add_gpu_node(dev, 3)
    assert gpu_nodes(dev) == [node]
    argv = [sys.executable, "-m", "jupyter_gpu_hotplug.nvml.sim.load", "--seconds", "600"]
    with subprocess.Popen([*argv, "--dev", str(dev)], stdout=subprocess.PIPE, text=True) as helper:
        try:
            assert helper.stdout is not None
            assert helper.stdout.readline().startswith(f"SIMULATED load: using {node} for 600 s")
            gpu = CharDevice(major=195, minor=3)
            held = holders_by_device([helper.pid], [gpu])
            assert [holder.pid for holder in held[gpu]] == [helper.pid]
        finally:
            helper.terminate()
        assert helper.wait(timeout=60) == 0
    assert holders_by_device([os.getpid()], [CharDevice(major=195, minor=3)]) == {
        CharDevice(major=195, minor=3): []
    }


def test_the_load_helper_without_a_gpu_says_so(dev: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_hotplug.nvml.sim.load", "--dev", str(dev)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "has no GPU to use; attach one first" in done.stdout
