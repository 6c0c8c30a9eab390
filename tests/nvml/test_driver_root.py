"""The simulated driver root: laid out as NVIDIA's driver installs itself, for the toolkit.

``nvidia-ctk cdi generate --driver-root R`` finds the driver's libraries through ``R``'s own
``ld.so.cache`` and names mounts by the versioned files; these checks read the root back with
the system's own tools (``ldconfig -p``, ``readelf``) and run its ``nvidia-smi``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.nvml.sim import (
    CUDA_LIBRARY_NAME,
    DEFAULT_DRIVER_VERSION,
    LIBRARY_NAME,
    FakeNvmlConfig,
    default_gpus,
    write_config,
)
from jupyter_gpu_hotplug.nvml.sim.driver_root import (
    LIBRARY_DIR,
    SMI_PATH,
    ensure_driver_root,
    versioned_name,
)
from jupyter_gpu_hotplug.nvml.sim.smi import BANNER
from tests.fixtures.requirements import needs_root

# ldconfig -r chroots; the compiler runs.
pytestmark = [*needs_root, pytest.mark.slow]

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_driver_root(tmp_path_factory.mktemp("cache"))


def soname(path: Path) -> str:
    dynamic = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return next(line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "SONAME" in line)


def test_libraries_are_versioned_files_with_soname_links(root: Path) -> None:
    libdir = root / LIBRARY_DIR
    for name in (LIBRARY_NAME, CUDA_LIBRARY_NAME):
        versioned = libdir / versioned_name(name)
        assert versioned.name.endswith(f".so.{DEFAULT_DRIVER_VERSION}")
        assert versioned.is_file() and not versioned.is_symlink()
        assert soname(versioned) == name
        assert os.readlink(libdir / name) == versioned.name, "relative: valid in any mount"
    assert os.readlink(libdir / "libcuda.so") == CUDA_LIBRARY_NAME


def test_its_own_ld_so_cache_lists_the_driver(root: Path) -> None:
    listed = subprocess.run(
        ["ldconfig", "-p", "-C", str(root / "etc/ld.so.cache")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in (LIBRARY_NAME, CUDA_LIBRARY_NAME):
        assert f"{name} (libc6,x86-64) => /{LIBRARY_DIR}/{name}" in listed


def test_a_second_call_reuses_the_root(root: Path) -> None:
    assert ensure_driver_root(root.parent) == root


def test_nvidia_smi_runs_the_simulated_one_with_the_python_it_finds(
    root: Path, tmp_path: Path
) -> None:
    config = tmp_path / "nvml.conf"
    gpus = default_gpus(2)
    write_config(config, FakeNvmlConfig(gpus=gpus))
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHONPATH": str(REPOSITORY),
        "LD_LIBRARY_PATH": str(root / LIBRARY_DIR),
        "FAKE_NVML_CONFIG": str(config),
    }
    listed = subprocess.run(
        [str(root / SMI_PATH), "-L"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert listed.splitlines() == [
        BANNER,
        *(f"GPU {i}: {gpu.name} (UUID: {gpu.uuid})" for i, gpu in enumerate(gpus)),
    ]


def test_nvidia_smi_says_what_it_needs_where_there_is_no_python(root: Path) -> None:
    done = subprocess.run(
        [str(root / SMI_PATH)], env={"PATH": "/nonexistent"}, capture_output=True, text=True
    )
    assert done.returncode == 127
    assert BANNER in done.stderr and "python3 with jupyter-gpu-hotplug" in done.stderr
