"""A simulated NVIDIA driver: a fake ``libnvidia-ml.so.1`` that the unmodified ``pynvml`` loads.

Used by the agent's ``--simulate N`` mode, local demos and the tests, on machines with no GPU.
The pieces, each in its own module:

- ``config``: the simulated GPUs (and their MIG devices) as frozen dataclasses and the
  versioned file the library reads; rewrite it (atomically) to change utilisation or hot-plug
  GPUs while processes run. It also writes the ``nvidia-caps`` minors file of a simulated node.
- ``build``: compiles ``fakenvml.c`` (and ``fakecuda.c``, a ``libcuda.so.1`` that counts the
  GPU nodes a process may open and implements the driver's process checkpoint calls) once into
  a cache keyed by source and compiler.
- ``driver_root``: a directory laid out as NVIDIA's driver installs itself (versioned
  libraries, ``nvidia-smi``, ``ld.so.cache``), for NVIDIA's Container Toolkit to describe.
- ``runtime``: the environment for a child process, or a load into this process.

Everything simulated is labelled: generated GPU names end in ``(simulated)`` and
``is_fake_library`` tells the product to report ``"simulated": true``.
"""

from __future__ import annotations

from .build import (
    CACHE_DIR_ENV,
    COMPILE_FLAGS,
    CUDA_LIBRARY_NAME,
    LIBRARY_NAME,
    build_key,
    default_cache_dir,
    ensure_fake_cuda,
    ensure_fake_nvml,
    fake_cuda_source,
    fake_nvml_source,
    find_compiler,
)
from .config import (
    DEFAULT_CUDA_DRIVER_VERSION,
    DEFAULT_DRIVER_VERSION,
    FORMAT_VERSION,
    H100_SXM,
    MAX_GPU_MINOR,
    MAX_GPUS,
    MAX_MIG_DEVICES,
    MAX_NVLINKS,
    MAX_PROCESSES,
    SIMULATED_SUFFIX,
    FakeNvmlConfig,
    GpuModel,
    GpuUuid,
    MigMode,
    SimulatedGpu,
    SimulatedMigDevice,
    SimulatedProcess,
    default_gpus,
    mig_caps_minors,
    parse_config,
    read_config,
    render_config,
    render_mig_minors,
    with_mig_devices,
    with_nvlinks,
    write_config,
)
from .errors import FakeNvmlBuildError, FakeNvmlConfigError, FakeNvmlError, FakeNvmlLoadError
from .runtime import (
    CONFIG_ENV,
    CUDA_DEV_DIR_ENV,
    DEVICE_FILTER_ENV,
    INIT_ERROR_ENV,
    fake_nvml_environ,
    is_fake_library,
    last_error,
    load_in_process,
)

__all__ = [
    "CACHE_DIR_ENV",
    "COMPILE_FLAGS",
    "CONFIG_ENV",
    "CUDA_DEV_DIR_ENV",
    "CUDA_LIBRARY_NAME",
    "DEFAULT_CUDA_DRIVER_VERSION",
    "DEFAULT_DRIVER_VERSION",
    "DEVICE_FILTER_ENV",
    "FORMAT_VERSION",
    "H100_SXM",
    "INIT_ERROR_ENV",
    "LIBRARY_NAME",
    "MAX_GPUS",
    "MAX_GPU_MINOR",
    "MAX_MIG_DEVICES",
    "MAX_NVLINKS",
    "MAX_PROCESSES",
    "SIMULATED_SUFFIX",
    "FakeNvmlBuildError",
    "FakeNvmlConfig",
    "FakeNvmlConfigError",
    "FakeNvmlError",
    "FakeNvmlLoadError",
    "GpuModel",
    "GpuUuid",
    "MigMode",
    "SimulatedGpu",
    "SimulatedMigDevice",
    "SimulatedProcess",
    "build_key",
    "default_cache_dir",
    "default_gpus",
    "ensure_fake_cuda",
    "ensure_fake_nvml",
    "fake_cuda_source",
    "fake_nvml_environ",
    "fake_nvml_source",
    "find_compiler",
    "is_fake_library",
    "last_error",
    "load_in_process",
    "mig_caps_minors",
    "parse_config",
    "read_config",
    "render_config",
    "render_mig_minors",
    "with_mig_devices",
    "with_nvlinks",
    "write_config",
]
