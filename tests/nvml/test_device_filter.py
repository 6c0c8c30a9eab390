"""The container view: with ``FAKE_NVML_DEVICE_FILTER``, only GPUs with a device node are seen.

Real NVML in a container enumerates the GPUs whose ``/dev/nvidia<minor>`` exists there; this is
what makes a hot-attached GPU appear in a running notebook. The tests create real character
nodes (``c 195:<minor>``) in a temporary directory, which needs ``CAP_MKNOD``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.nvml.sim import default_gpus
from tests.fixtures.nvml import FakeNvml, FakeNvmlNode, add_gpu_node
from tests.fixtures.requirements import needs_root

pytestmark = needs_root


def visible_uuids() -> list[str]:
    return [
        pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
        for i in range(pynvml.nvmlDeviceGetCount())
    ]


@pytest.fixture
def filtered(fake_nvml: FakeNvml, dev: Path) -> FakeNvml:
    """Three GPUs (minors 0..2) on the node, seen through ``dev`` from the next ``nvmlInit``."""
    fake_nvml.write(default_gpus(3))
    fake_nvml.set_device_filter(dev)
    return fake_nvml


def test_only_gpus_with_a_node_are_visible(filtered: FakeNvml, dev: Path) -> None:
    first, second, _ = filtered.gpus
    add_gpu_node(dev, second.minor)
    pynvml.nvmlInit()
    try:
        assert visible_uuids() == [second.uuid]
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetMinorNumber(handle) == second.minor
        assert pynvml.nvmlDeviceGetIndex(handle) == 0
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID(first.uuid)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByPciBusId(first.pci_bus_id)
    finally:
        pynvml.nvmlShutdown()


def test_attach_and_detach_are_seen_without_reinit(filtered: FakeNvml, dev: Path) -> None:
    first, _, third = filtered.gpus
    pynvml.nvmlInit()
    try:
        assert pynvml.nvmlDeviceGetCount() == 0
        add_gpu_node(dev, third.minor)
        add_gpu_node(dev, first.minor)
        assert visible_uuids() == [first.uuid, third.uuid], "NVML order, not attach order"
        held = pynvml.nvmlDeviceGetHandleByUUID(third.uuid)
        (dev / f"nvidia{third.minor}").unlink()
        assert visible_uuids() == [first.uuid]
        # Like a process that opened the GPU before it was revoked, a held handle still reads;
        # it just has no index in this process's view any more.
        assert pynvml.nvmlDeviceGetUUID(held) == third.uuid
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetIndex(held)
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.parametrize("kind", ["regular file", "directory", "block device"])
def test_only_character_devices_count(filtered: FakeNvml, dev: Path, kind: str) -> None:
    node = dev / "nvidia0"
    if kind == "regular file":
        node.touch()
    elif kind == "directory":
        node.mkdir()
    else:
        os.mknod(node, 0o600 | stat.S_IFBLK, os.makedev(NVIDIA_MAJOR, 0))
    pynvml.nvmlInit()
    try:
        assert pynvml.nvmlDeviceGetCount() == 0
    finally:
        pynvml.nvmlShutdown()


def test_child_process_sees_only_attached_gpus(
    fake_nvml_node: FakeNvmlNode, dev: Path, tmp_path: Path
) -> None:
    fake_nvml_node.write(default_gpus(3))
    add_gpu_node(dev, 2)
    script = (
        "import json, pynvml\n"
        "pynvml.nvmlInit()\n"
        "print(json.dumps([pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByIndex(i))"
        " for i in range(pynvml.nvmlDeviceGetCount())]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=fake_nvml_node.environ(device_filter=dev),
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert json.loads(result.stdout) == [2]
