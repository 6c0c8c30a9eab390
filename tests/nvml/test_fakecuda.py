"""The fake ``libcuda.so.1``: a process sees exactly the GPU nodes it may open.

What a CUDA program in a container asks first (``cuInit``, ``cuDeviceGetCount``) must follow
the container's device nodes and device cgroup, as the real driver does: a node that opens, or
fails with ENXIO (a simulated GPU has no driver behind its major), is a GPU; EACCES, EPERM or
no node is none. Each check loads the library with ``ctypes`` in a fresh subprocess (the
library fixes its device list at the first ``cuInit``, as the real driver does), against real
character nodes made with ``mknod`` in a temporary directory (``FAKE_CUDA_DEV_DIR``).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import pytest

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.nvml.sim import (
    CONFIG_ENV,
    CUDA_DEV_DIR_ENV,
    CUDA_LIBRARY_NAME,
    DEFAULT_CUDA_DRIVER_VERSION,
    FakeNvmlConfig,
    default_gpus,
    ensure_fake_cuda,
    write_config,
)
from tests.fixtures.nvml import add_gpu_node
from tests.fixtures.requirements import needs_root

pytestmark = [*needs_root, pytest.mark.slow]

NOBODY: Final = 65534
SYSTEM_PYTHON: Final = "/usr/bin/python3"
"""Runs the stdlib-only probe: a virtualenv under root's home may not be ``nobody``'s to run."""
# CUresult codes (cuda.h).
CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED = 1, 3
CUDA_ERROR_NO_DEVICE, CUDA_ERROR_INVALID_DEVICE = 100, 101

PROBE: Final = """
import ctypes, json, sys
cuda = ctypes.CDLL(sys.argv[1])
def text(function, code):
    out = ctypes.c_char_p()
    result = function(code, ctypes.byref(out))
    return [result, out.value.decode() if out.value else None]
version = ctypes.c_int()
report = {"version": [cuda.cuDriverGetVersion(ctypes.byref(version)), version.value]}
count = ctypes.c_int(-1)
report["count_before_init"] = cuda.cuDeviceGetCount(ctypes.byref(count))
report["init"] = cuda.cuInit(0)
report["count"] = [cuda.cuDeviceGetCount(ctypes.byref(count)), count.value]
names = []
for ordinal in range(max(count.value, 0) + 1):
    device = ctypes.c_int(-1)
    found = cuda.cuDeviceGet(ctypes.byref(device), ordinal)
    name = ctypes.create_string_buffer(96)
    named = cuda.cuDeviceGetName(name, 96, device) if found == 0 else None
    names.append([found, named, name.value.decode() if named == 0 else None])
report["devices"] = names
report["init_flags"] = cuda.cuInit(1)
report["error_name"] = text(cuda.cuGetErrorName, 100)
report["error_string"] = text(cuda.cuGetErrorString, 100)
report["unknown_error"] = text(cuda.cuGetErrorName, 12345)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    """A world-readable directory (``tmp_path`` is root's alone): the library, the config and
    the ``/dev`` stand-in, so that a probe running as ``nobody`` reaches them."""
    directory = Path(tempfile.mkdtemp(prefix="jgh-fakecuda-"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


@pytest.fixture(scope="module")
def library(shared_dir: Path) -> Path:
    built = ensure_fake_cuda(shared_dir / "cache")
    shared_dir.joinpath("cache").chmod(0o755)
    return built / CUDA_LIBRARY_NAME


@pytest.fixture
def dev(shared_dir: Path) -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="dev-", dir=shared_dir))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def probe(
    library: Path, dev: Path, *, env: Mapping[str, str] = {}, user: int | None = None
) -> dict[str, Any]:
    environ = {"PATH": os.environ.get("PATH", ""), CUDA_DEV_DIR_ENV: str(dev), **env}
    done = subprocess.run(
        [
            SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable,
            "-c",
            PROBE,
            str(library),
        ],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        user=user,
        group=user,
        extra_groups=[] if user is not None else None,
    )
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_counts_the_gpu_nodes_it_can_open_named_from_the_nvml_config(
    library: Path, dev: Path, shared_dir: Path
) -> None:
    gpus = default_gpus(3)
    config = shared_dir / "nvml.conf"
    write_config(config, FakeNvmlConfig(gpus=gpus, cuda_driver_version=12080))
    add_gpu_node(dev, gpus[2].minor)
    add_gpu_node(dev, gpus[0].minor)
    # Not GPUs: the control node, another NVIDIA node, a file and a block device by GPU names.
    os.mknod(dev / "nvidiactl", 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, 255))
    os.mknod(dev / "nvidia-uvm", 0o666 | stat.S_IFCHR, os.makedev(511, 0))
    (dev / "nvidia1").touch()
    os.mknod(dev / "nvidia7", 0o666 | stat.S_IFBLK, os.makedev(NVIDIA_MAJOR, 7))

    report = probe(library, dev, env={CONFIG_ENV: str(config)})

    assert report["version"] == [0, 12080], "the config's cuda_driver_version wins"
    assert report["count_before_init"] == CUDA_ERROR_NOT_INITIALIZED
    assert report["init"] == 0
    assert report["count"] == [0, 2]
    assert report["devices"] == [
        [0, 0, gpus[0].name],
        [0, 0, gpus[2].name],
        [CUDA_ERROR_INVALID_DEVICE, None, None],
    ], "ordered by minor, named by the config's [gpu] of that minor"
    assert report["init_flags"] == CUDA_ERROR_INVALID_VALUE


def test_no_node_is_no_device(library: Path, dev: Path) -> None:
    report = probe(library, dev)
    assert report["init"] == CUDA_ERROR_NO_DEVICE
    assert report["count"][0] == CUDA_ERROR_NOT_INITIALIZED
    assert report["version"] == [0, DEFAULT_CUDA_DRIVER_VERSION], "no config: the built-in one"
    assert report["error_name"] == [0, "CUDA_ERROR_NO_DEVICE"]
    assert report["error_string"] == [0, "no CUDA-capable device is detected"]
    assert report["unknown_error"] == [CUDA_ERROR_INVALID_VALUE, None]


def test_a_node_it_may_not_open_is_not_its_gpu(library: Path, dev: Path) -> None:
    """Run as ``nobody``: ``nvidia0`` (root's, 0600) fails with EACCES, ``nvidia1`` (0666)
    opens as far as the kernel's ENXIO. Without a config every GPU has the fixed name."""
    add_gpu_node(dev, 0)
    add_gpu_node(dev, 1).chmod(0o666)
    report = probe(library, dev, user=NOBODY)
    assert report["count"] == [0, 1]
    assert report["devices"][0] == [0, 0, "SIMULATED GPU"]
