"""Compile the simulated driver's libraries on first use: ``fakenvml.c`` into a cached
``libnvidia-ml.so.1`` and ``fakecuda.c`` into ``libcuda.so.1``.

Boundary: finding a C compiler, the build cache and running the compiler; nothing about what
the libraries simulate. Each library is a ``FakeLibrary`` (source, SONAME, flags); one build
path serves both.

Why build at run time instead of shipping a binary: the package stays pure Python (one wheel
for every platform), and simulation is a development and demo feature on machines that have a
compiler anyway. The cache is keyed by a hash of the source, the flags and the compiler's
identity, so an upgraded package or compiler rebuilds, and an unchanged one costs one hash.
A build lands in a private directory that is renamed into place, so processes that start at
the same moment never see a half-written library; the loser of the race discards its own copy.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final

from .config import DEFAULT_CUDA_DRIVER_VERSION
from .errors import FakeNvmlBuildError

__all__ = [
    "CACHE_DIR_ENV",
    "COMPILE_FLAGS",
    "CUDA_LIBRARY",
    "CUDA_LIBRARY_NAME",
    "LIBRARY_NAME",
    "NVML_LIBRARY",
    "FakeLibrary",
    "build_key",
    "default_cache_dir",
    "ensure_fake_cuda",
    "ensure_fake_nvml",
    "fake_cuda_source",
    "fake_nvml_source",
    "find_compiler",
]

LIBRARY_NAME: Final = "libnvidia-ml.so.1"
"""File name and SONAME: what pynvml passes to dlopen()."""

CACHE_DIR_ENV: Final = "GPU_HOTPLUG_CACHE_DIR"
"""Overrides the cache root (``$XDG_CACHE_HOME/jupyter-gpu-hotplug`` by default)."""

CUDA_LIBRARY_NAME: Final = "libcuda.so.1"
"""File name and SONAME of the fake CUDA driver library (what CUDA programs link against)."""

_BASE_FLAGS: Final = (
    "-O2",
    "-std=c11",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
)


@dataclass(frozen=True)
class FakeLibrary:
    """One library of the simulated driver: its C source in this package, its SONAME (also
    the file name), the cache subdirectory prefix, and the ``-D`` defines the source needs."""

    source_name: str
    soname: str
    cache_prefix: str
    description: str
    """For messages: "fake NVML library"."""
    defines: tuple[str, ...] = ()

    @property
    def flags(self) -> tuple[str, ...]:
        """The compiler flags. The SONAME is what lets an in-process load by absolute path
        satisfy a later ``dlopen`` by name (pynvml's ``dlopen("libnvidia-ml.so.1")``)."""
        return (*_BASE_FLAGS, *self.defines, f"-Wl,-soname,{self.soname}")


NVML_LIBRARY: Final = FakeLibrary("fakenvml.c", LIBRARY_NAME, "fakenvml", "fake NVML library")
CUDA_LIBRARY: Final = FakeLibrary(
    "fakecuda.c",
    CUDA_LIBRARY_NAME,
    "fakecuda",
    "fake CUDA driver library",
    # One definition of the simulated CUDA version: the C source has no default of its own.
    defines=(f"-DFAKE_CUDA_DRIVER_VERSION={DEFAULT_CUDA_DRIVER_VERSION}",),
)

COMPILE_FLAGS: Final = NVML_LIBRARY.flags
"""Flags of the fake NVML's build."""

SOURCE_NAME: Final = NVML_LIBRARY.source_name
_COMPILER_CANDIDATES: Final = ("cc", "gcc")
_COMPILE_TIMEOUT_S: Final = 120
_INSTALL_HINT: Final = "install gcc (apt-get install gcc)"


def _source(library: FakeLibrary) -> bytes:
    return resources.files(__package__).joinpath(library.source_name).read_bytes()


def fake_nvml_source() -> bytes:
    """The fake NVML's C source shipped inside this package."""
    return _source(NVML_LIBRARY)


def fake_cuda_source() -> bytes:
    """The fake CUDA driver library's C source shipped inside this package."""
    return _source(CUDA_LIBRARY)


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The cache root: ``$GPU_HOTPLUG_CACHE_DIR``, else the XDG cache dir, else ``~/.cache``.

    A relative ``XDG_CACHE_HOME`` is ignored, as the XDG spec requires.
    """
    env = os.environ if environ is None else environ
    if override := env.get(CACHE_DIR_ENV):
        return Path(override)
    xdg = env.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "jupyter-gpu-hotplug"
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".cache" / "jupyter-gpu-hotplug"


def find_compiler(
    compiler: str | None = None, *, environ: Mapping[str, str] | None = None
) -> list[str]:
    """The compiler command line prefix: ``compiler``, else ``$CC``, else ``cc`` or ``gcc``.

    ``compiler`` and ``$CC`` may carry arguments (``"gcc -m64"``); the program is looked up on
    the ``PATH`` of ``environ`` (default: this process's). Raises ``FakeNvmlBuildError`` with
    an install hint when nothing is found.
    """
    env = os.environ if environ is None else environ
    path = env.get("PATH", "")
    requested = compiler or env.get("CC")
    if requested:
        argv = shlex.split(requested)
        program = shutil.which(argv[0], path=path) if argv else None
        if program is None:
            raise FakeNvmlBuildError(
                f"C compiler {requested!r} not found: the GPU simulator compiles its fake driver "
                f"libraries on first use; {_INSTALL_HINT} or name another compiler"
            )
        return [program, *argv[1:]]
    for candidate in _COMPILER_CANDIDATES:
        program = shutil.which(candidate, path=path)
        if program is not None:
            return [program]
    raise FakeNvmlBuildError(
        f"no C compiler found (looked for $CC, {', '.join(_COMPILER_CANDIDATES)} on PATH): "
        f"the GPU simulator compiles its fake driver libraries on first use; {_INSTALL_HINT}"
    )


def build_key(source: bytes, compiler: Sequence[str], flags: Sequence[str] = COMPILE_FLAGS) -> str:
    """Hex digest naming one build: source, flags, machine and the compiler binary's identity.

    The compiler is identified by its resolved path, size and mtime rather than by running
    ``--version``, which keeps a cache hit free of subprocesses while still rebuilding after a
    compiler upgrade.
    """
    program = os.path.realpath(compiler[0])
    stat = os.stat(program)
    identity = [*flags, *compiler, program, str(stat.st_size), str(stat.st_mtime_ns)]
    identity.append(platform.machine())
    digest = hashlib.sha256(source)
    digest.update("\0".join(identity).encode())
    return digest.hexdigest()


def ensure_fake_nvml(
    cache_dir: Path | None = None,
    *,
    compiler: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Path:
    """The directory holding a compiled ``libnvidia-ml.so.1``, building it if needed.

    ``cache_dir`` defaults to ``default_cache_dir(environ)``; the build goes to a subdirectory
    named by ``build_key``, so put the returned path on ``LD_LIBRARY_PATH`` or load the file in
    it. Directories and the library are made world-readable: simulated kernels may run as a
    user other than the process that built it, so choose a cache root they can reach.
    Old builds are kept, since running processes may still have them mapped.
    """
    return _ensure(NVML_LIBRARY, fake_nvml_source(), cache_dir, compiler, environ)


def ensure_fake_cuda(
    cache_dir: Path | None = None,
    *,
    compiler: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Path:
    """The directory holding a compiled ``libcuda.so.1``, building it if needed; as
    ``ensure_fake_nvml`` (same cache root, same rules)."""
    return _ensure(CUDA_LIBRARY, fake_cuda_source(), cache_dir, compiler, environ)


def _ensure(
    library: FakeLibrary,
    source: bytes,
    cache_dir: Path | None,
    compiler: str | None,
    environ: Mapping[str, str] | None,
) -> Path:
    root = default_cache_dir(environ) if cache_dir is None else cache_dir
    argv = find_compiler(compiler, environ=environ)
    target = root / f"{library.cache_prefix}-{build_key(source, argv, library.flags)[:24]}"
    if (target / library.soname).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    try:
        _compile(library, argv, source, staging)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same build first; its result is identical.
            if not (target / library.soname).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def _compile(library: FakeLibrary, argv: Sequence[str], source: bytes, directory: Path) -> None:
    """Compile ``source`` into ``directory/<soname>``, keeping the source beside it."""
    source_path = directory / library.source_name
    source_path.write_bytes(source)
    source_path.chmod(0o644)
    output = directory / library.soname
    command = [*argv, *library.flags, "-o", str(output), str(source_path)]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise FakeNvmlBuildError(
            f"compiling the {library.description} took over {_COMPILE_TIMEOUT_S}s: "
            f"{shlex.join(command)}"
        ) from error
    except OSError as error:
        raise FakeNvmlBuildError(f"cannot run the C compiler {argv[0]}: {error}") from error
    if result.returncode != 0 or not output.is_file():
        raise FakeNvmlBuildError(
            f"compiling the {library.description} failed (exit {result.returncode}): "
            f"{shlex.join(command)}\n{result.stderr.strip()}"
        )
    output.chmod(0o755)
