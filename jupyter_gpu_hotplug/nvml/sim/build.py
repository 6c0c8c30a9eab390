"""Compile ``fakenvml.c`` into a cached ``libnvidia-ml.so.1`` on first use.

Boundary: finding a C compiler, the build cache and running the compiler; nothing about what
the library simulates.

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
from importlib import resources
from pathlib import Path
from typing import Final

from .errors import FakeNvmlBuildError

__all__ = [
    "CACHE_DIR_ENV",
    "COMPILE_FLAGS",
    "LIBRARY_NAME",
    "build_key",
    "default_cache_dir",
    "ensure_fake_nvml",
    "fake_nvml_source",
    "find_compiler",
]

LIBRARY_NAME: Final = "libnvidia-ml.so.1"
"""File name and SONAME: what pynvml passes to dlopen()."""

CACHE_DIR_ENV: Final = "GPU_HOTPLUG_CACHE_DIR"
"""Overrides the cache root (``$XDG_CACHE_HOME/jupyter-gpu-hotplug`` by default)."""

COMPILE_FLAGS: Final = (
    "-O2",
    "-std=c11",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    f"-Wl,-soname,{LIBRARY_NAME}",
)
"""Flags for every build. The SONAME is what lets an in-process load by absolute path satisfy
pynvml's later ``dlopen("libnvidia-ml.so.1")``."""

SOURCE_NAME: Final = "fakenvml.c"
_COMPILER_CANDIDATES: Final = ("cc", "gcc")
_COMPILE_TIMEOUT_S: Final = 120
_INSTALL_HINT: Final = "install gcc (apt-get install gcc)"


def fake_nvml_source() -> bytes:
    """The C source shipped inside this package."""
    return resources.files(__package__).joinpath(SOURCE_NAME).read_bytes()


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
                f"C compiler {requested!r} not found: the GPU simulator compiles its fake NVML "
                f"library on first use; {_INSTALL_HINT} or name another compiler"
            )
        return [program, *argv[1:]]
    for candidate in _COMPILER_CANDIDATES:
        program = shutil.which(candidate, path=path)
        if program is not None:
            return [program]
    raise FakeNvmlBuildError(
        f"no C compiler found (looked for $CC, {', '.join(_COMPILER_CANDIDATES)} on PATH): "
        f"the GPU simulator compiles its fake NVML library on first use; {_INSTALL_HINT}"
    )


def build_key(source: bytes, compiler: Sequence[str]) -> str:
    """Hex digest naming one build: source, flags, machine and the compiler binary's identity.

    The compiler is identified by its resolved path, size and mtime rather than by running
    ``--version``, which keeps a cache hit free of subprocesses while still rebuilding after a
    compiler upgrade.
    """
    program = os.path.realpath(compiler[0])
    stat = os.stat(program)
    identity = [*COMPILE_FLAGS, *compiler, program, str(stat.st_size), str(stat.st_mtime_ns)]
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
    root = default_cache_dir(environ) if cache_dir is None else cache_dir
    argv = find_compiler(compiler, environ=environ)
    source = fake_nvml_source()
    target = root / f"fakenvml-{build_key(source, argv)[:24]}"
    if (target / LIBRARY_NAME).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    try:
        _compile(argv, source, staging)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same build first; its result is identical.
            if not (target / LIBRARY_NAME).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def _compile(argv: Sequence[str], source: bytes, directory: Path) -> None:
    """Compile ``source`` into ``directory/libnvidia-ml.so.1``, keeping the source beside it."""
    source_path = directory / SOURCE_NAME
    source_path.write_bytes(source)
    source_path.chmod(0o644)
    output = directory / LIBRARY_NAME
    command = [*argv, *COMPILE_FLAGS, "-o", str(output), str(source_path)]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise FakeNvmlBuildError(
            f"compiling the fake NVML library took over {_COMPILE_TIMEOUT_S}s: "
            f"{shlex.join(command)}"
        ) from error
    except OSError as error:
        raise FakeNvmlBuildError(f"cannot run the C compiler {argv[0]}: {error}") from error
    if result.returncode != 0 or not output.is_file():
        raise FakeNvmlBuildError(
            f"compiling the fake NVML library failed (exit {result.returncode}): "
            f"{shlex.join(command)}\n{result.stderr.strip()}"
        )
    output.chmod(0o755)
