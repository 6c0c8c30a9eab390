"""Per-kernel attribution's grouping: NVML's processes (the simulated NVML, configured through
its config) grouped by real process trees this test starts, read from the real ``/proc``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PID_MAX_LIMIT
from jupyter_gpu_hotplug.nvml.attribution import ProcessTree, Usage, attribute
from jupyter_gpu_hotplug.nvml.sim import SimulatedProcess
from jupyter_gpu_hotplug.nvml.state import GpuMonitor, GpuProcess
from tests.fixtures.nvml import FakeNvml

GIB = 2**30

_PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen(['sleep', '600'])\n"
    "print(child.pid, flush=True)\n"
    "try:\n"
    "    time.sleep(600)\n"
    "finally:\n"
    "    child.kill()\n"
)


@pytest.fixture
def kernels() -> Iterator[tuple[int, int, int]]:
    """Two stand-ins for kernels: ``a`` with a child (a training script), ``b`` alone.
    Returns (a, a's child, b)."""
    a = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    b = subprocess.Popen(["sleep", "600"])
    try:
        assert a.stdout is not None
        child = int(a.stdout.readline())
        yield a.pid, child, b.pid
    finally:
        for process in (a, b):
            process.terminate()
            process.wait()
        if a.stdout is not None:
            a.stdout.close()


def test_processes_are_grouped_by_the_kernel_they_run_below(
    kernels: tuple[int, int, int], fake_nvml: FakeNvml, dev: Path
) -> None:
    a, child, b = kernels
    gone = PID_MAX_LIMIT  # no process has this pid here: as a host pid seen from a container
    fake_nvml.update_gpu(
        fake_nvml.gpus[0].uuid,
        processes=(
            SimulatedProcess(child, 3 * GIB, 40),
            SimulatedProcess(a, GIB, 5),
            SimulatedProcess(b, 2 * GIB),
            SimulatedProcess(gone, 4 * GIB, 30),
            SimulatedProcess(1, 5 * GIB),
        ),
    )
    with GpuMonitor(dev_dir=dev) as monitor:
        processes = monitor.snapshot().gpus[0].processes
    assert processes is not None

    use = attribute(processes, {a: "a", b: "b"}.get, ProcessTree())

    assert use.by_owner == {
        "a": Usage(memory_bytes=4 * GIB, sm_util_percent=45, processes=2),
        "b": Usage(memory_bytes=2 * GIB, sm_util_percent=None, processes=1),
    }
    assert use.unattributed == Usage(memory_bytes=4 * GIB, sm_util_percent=30, processes=1)
    assert use.others == Usage(memory_bytes=5 * GIB, sm_util_percent=None, processes=1)


def test_the_nearest_root_wins(kernels: tuple[int, int, int]) -> None:
    """A kernel runs below its server: its processes are the kernel's, not the server's."""
    a, child, _ = kernels
    tree = ProcessTree()
    server = tree.parent(a)
    assert server is not None

    assert tree.owner(child, {a: "kernel", server: "server"}.get) == "kernel"
    assert tree.owner(a, {server: "server"}.get) == "server"


def test_unknown_memory_stays_unknown() -> None:
    """NVML without memory figures (many containers): ``None``, never a claimed 0."""
    nobody: dict[int, str] = {}
    use = attribute([GpuProcess(PID_MAX_LIMIT, None, None)], nobody.get, ProcessTree())

    assert use.unattributed == Usage(memory_bytes=None, sm_util_percent=None, processes=1)


def test_a_command_with_parentheses_and_spaces_is_parsed(tmp_path: Path) -> None:
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "stat").write_bytes(b"12 (evil) 1 (x) S 7 12 12 0 -1\n")
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_bytes(b"7 (init) S 0 7 7 0 -1\n")

    tree = ProcessTree(tmp_path)

    assert tree.parent(12) == 7
    assert tree.owner(12, {7: "root"}.get) == "root"
    assert tree.parent(13) is None
    assert not tree.visible(13)
