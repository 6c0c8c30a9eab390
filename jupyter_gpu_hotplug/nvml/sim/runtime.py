"""Point a process at the fake NVML: the environment for a child, or a load in this process.

Boundary: environment variables and ``dlopen``; the library must already be built
(``build.ensure_fake_nvml``) and the config written (``config.write_config``).

Why it exists: ``pynvml`` has no setting for the library path; it calls
``dlopen("libnvidia-ml.so.1")``. A child finds the fake through ``LD_LIBRARY_PATH`` set before
it starts (kernels inherit it). This process can instead load the fake by absolute path before
pynvml's first ``nvmlInit``: glibc then answers pynvml's lookup with the loaded library of that
SONAME. Both paths are checked here, because a real NVML that got there first would otherwise
be used silently.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from .build import LIBRARY_NAME
from .config import FORMAT_VERSION
from .errors import FakeNvmlLoadError

__all__ = [
    "CONFIG_ENV",
    "CUDA_DEV_DIR_ENV",
    "DEVICE_FILTER_ENV",
    "INIT_ERROR_ENV",
    "fake_nvml_environ",
    "is_fake_library",
    "last_error",
    "load_in_process",
]

CONFIG_ENV: Final = "FAKE_NVML_CONFIG"
"""Path of the config file the library reads (at every ``nvmlInit``)."""
INIT_ERROR_ENV: Final = "FAKE_NVML_INIT_ERROR"
"""An ``nvmlReturn_t`` code that ``nvmlInit`` returns instead of succeeding (e.g. 9)."""
DEVICE_FILTER_ENV: Final = "FAKE_NVML_DEVICE_FILTER"
"""A directory (normally ``/dev``): only GPUs whose ``nvidia<minor>`` char node exists there
are visible, as for NVML inside a container."""

CUDA_DEV_DIR_ENV: Final = "FAKE_CUDA_DEV_DIR"
"""Where the fake ``libcuda.so.1`` looks for ``nvidia<N>`` nodes (default ``/dev``): tests point
it at a directory of their own nodes."""

_FAKE_MARKER: Final = "fakeNvmlConfigFormat"
_LAST_ERROR_BYTES: Final = 512


def fake_nvml_environ(
    library_dir: Path,
    config_path: Path,
    *,
    device_filter: Path | None = None,
    init_error: int | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A full environment for a child process that should see the simulated GPUs.

    ``base`` (default: this process's environment) is copied; ``LD_LIBRARY_PATH`` gets
    ``library_dir`` in front, paths are made absolute (the child may change directory), and
    filter and init-error variables are set or removed so that ``base`` cannot leak its own.
    """
    env = dict(os.environ if base is None else base)
    library = os.path.abspath(library_dir)
    inherited = [entry for entry in env.get("LD_LIBRARY_PATH", "").split(":") if entry]
    env["LD_LIBRARY_PATH"] = ":".join([library, *(e for e in inherited if e != library)])
    env[CONFIG_ENV] = os.path.abspath(config_path)
    if device_filter is None:
        env.pop(DEVICE_FILTER_ENV, None)
    else:
        env[DEVICE_FILTER_ENV] = os.path.abspath(device_filter)
    if init_error is None:
        env.pop(INIT_ERROR_ENV, None)
    else:
        env[INIT_ERROR_ENV] = str(init_error)
    return env


def is_fake_library(library: ctypes.CDLL) -> bool:
    """Whether ``library`` is this simulator rather than a real driver's NVML.

    The product reports ``"simulated": true`` for GPUs it reads through such a library.
    """
    return hasattr(library, _FAKE_MARKER)


def last_error(library: ctypes.CDLL) -> str:
    """Why the fake's last ``nvmlInit`` or config reload failed; empty after a good load.

    An NVML error code alone ("Unknown Error") does not say which line of the config is wrong.
    """
    get = library.fakeNvmlGetLastError
    get.restype = ctypes.c_int
    get.argtypes = [ctypes.c_char_p, ctypes.c_uint]
    buffer = ctypes.create_string_buffer(_LAST_ERROR_BYTES)
    get(buffer, _LAST_ERROR_BYTES)
    return buffer.value.decode(errors="replace")


def _address(library: ctypes.CDLL) -> int | None:
    return ctypes.cast(getattr(library, _FAKE_MARKER), ctypes.c_void_p).value


def load_in_process(library_dir: Path) -> ctypes.CDLL:
    """Make the fake the ``libnvidia-ml.so.1`` of this process, before pynvml loads one.

    Idempotent. Raises ``FakeNvmlLoadError`` if the file cannot be loaded, if another NVML (a
    real one, or a different fake build) already owns the name in this process, or if the
    library reads another config format than this package writes.
    """
    path = Path(os.path.abspath(library_dir)) / LIBRARY_NAME
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise FakeNvmlLoadError(f"cannot load the fake NVML {path}: {error}") from error
    if not is_fake_library(library):
        raise FakeNvmlLoadError(f"{path} is not jupyter-gpu-hotplug's fake NVML")
    try:
        # What pynvml will get from its dlopen by name.
        by_name = ctypes.CDLL(LIBRARY_NAME)
    except OSError as error:
        raise FakeNvmlLoadError(
            f"{path} has no SONAME {LIBRARY_NAME}; rebuild it with ensure_fake_nvml()"
        ) from error
    if not is_fake_library(by_name) or _address(by_name) != _address(library):
        raise FakeNvmlLoadError(
            f"another {LIBRARY_NAME} was loaded in this process before {path}; one process "
            "holds one NVML, so run the simulation in a new process (see fake_nvml_environ)"
        )
    config_format = library.fakeNvmlConfigFormat
    config_format.restype = ctypes.c_uint
    config_format.argtypes = []
    if config_format() != FORMAT_VERSION:
        raise FakeNvmlLoadError(
            f"{path} reads config format {config_format()}, this package writes {FORMAT_VERSION}"
        )
    return library
