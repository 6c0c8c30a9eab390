"""A simulated NVIDIA driver installation: a directory laid out as the driver installs itself.

NVIDIA's Container Toolkit (``nvidia-ctk cdi generate --driver-root R``) and NVIDIA's device
plugin in CDI mode describe a node's driver by what they find under its root: the versioned
libraries ``libnvidia-ml.so.<version>`` and ``libcuda.so.<version>`` in the library directory,
the root's own ``/etc/ld.so.cache`` that lists them, and the driver's programs
(``/usr/bin/nvidia-smi``). This module builds such a root from the simulator's pieces — the
compiled fake NVML and fake CUDA library, and a ``nvidia-smi`` that runs the simulated one —
so the real toolkit writes a real CDI spec for simulated GPUs.

Boundary: files, symlinks and ``ldconfig``; the libraries come from ``build``. Built once into
the simulator's cache, in a directory named by a hash of everything in it (the libraries' build
directories, the ``nvidia-smi`` script, the driver version and this layout), and renamed into
place so that concurrent callers never see half a root. ``ldconfig -r`` chroots, so building a
root needs root (``CAP_SYS_CHROOT``); using one does not.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from .build import (
    CUDA_LIBRARY_NAME,
    LIBRARY_NAME,
    default_cache_dir,
    ensure_fake_cuda,
    ensure_fake_nvml,
)
from .config import DEFAULT_DRIVER_VERSION
from .errors import FakeNvmlBuildError
from .smi import COMMAND_NAME, portable_command

__all__ = [
    "DRIVER_VERSION",
    "LIBRARY_DIR",
    "SMI_PATH",
    "ensure_driver_root",
    "versioned_name",
]

DRIVER_VERSION: Final = DEFAULT_DRIVER_VERSION
"""The version the root's files are named by; the fake NVML reports the same by default."""
LIBRARY_DIR: Final = Path("usr/lib/x86_64-linux-gnu")
"""Where NVIDIA's installer (and Debian's and Ubuntu's packages) put the driver's libraries on
x86-64, relative to the root."""
SMI_PATH: Final = Path("usr/bin") / COMMAND_NAME
LAYOUT: Final = 1
"""Bumped when the layout below changes, so that old cached roots are not reused."""
_LDCONFIG: Final = ("/sbin/ldconfig", "/usr/sbin/ldconfig")
_LDCONFIG_TIMEOUT_S: Final = 60


def versioned_name(soname: str, version: str = DRIVER_VERSION) -> str:
    """``libcuda.so.1`` → ``libcuda.so.550.54.15``: the file the driver installs for a SONAME."""
    stem, _, _ = soname.rpartition(".so.")
    return f"{stem}.so.{version}"


def ensure_driver_root(
    cache_dir: Path | None = None,
    *,
    compiler: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Path:
    """The simulated driver root ``R``, building it if needed. It holds:

    - ``R/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15`` and ``libcuda.so.550.54.15``
      (the compiled fakes, SONAMEs ``libnvidia-ml.so.1`` and ``libcuda.so.1``), with the
      ``.so.1`` symlinks ``ldconfig`` makes and the ``libcuda.so`` development link;
    - ``R/usr/bin/nvidia-smi``, a ``/bin/sh`` script that runs the simulated ``nvidia-smi``
      with the ``python3`` of wherever it runs (see ``smi.portable_command``);
    - ``R/etc/ld.so.conf`` and ``R/etc/ld.so.cache`` (``ldconfig -r R``): the toolkit finds
      the libraries through the root's own cache.

    ``cache_dir`` and ``compiler`` as for ``ensure_fake_nvml``. Raises ``FakeNvmlBuildError``
    when a library cannot be compiled or ``ldconfig`` fails (e.g. not root).
    """
    root = default_cache_dir(environ) if cache_dir is None else cache_dir
    nvml = ensure_fake_nvml(root, compiler=compiler, environ=environ) / LIBRARY_NAME
    cuda = ensure_fake_cuda(root, compiler=compiler, environ=environ) / CUDA_LIBRARY_NAME
    script = portable_command()
    key = hashlib.sha256(
        "\0".join([str(LAYOUT), DRIVER_VERSION, str(nvml), str(cuda), script]).encode()
    ).hexdigest()[:24]
    target = root / f"driver-root-{key}"
    if (target / "etc" / "ld.so.cache").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".driver-root-"))
    try:
        _lay_out(staging, {LIBRARY_NAME: nvml, CUDA_LIBRARY_NAME: cuda}, script)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same root first; its result is identical.
            if not (target / "etc" / "ld.so.cache").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def _lay_out(root: Path, libraries: Mapping[str, Path], script: str) -> None:
    libdir = root / LIBRARY_DIR
    libdir.mkdir(parents=True)
    for soname, built in libraries.items():
        versioned = libdir / versioned_name(soname)
        shutil.copyfile(built, versioned)
        versioned.chmod(0o755)
    # What the driver's installer adds beside ldconfig's SONAME links: the link a program
    # built against CUDA is linked with.
    (libdir / "libcuda.so").symlink_to(CUDA_LIBRARY_NAME)
    smi = root / SMI_PATH
    smi.parent.mkdir(parents=True)
    smi.write_text(script)
    smi.chmod(0o755)
    etc = root / "etc"
    etc.mkdir()
    (etc / "ld.so.conf").write_text(f"/{LIBRARY_DIR}\n")
    _ldconfig(root)
    # Readable by everyone whatever the umask: runtimes and hooks of other users read it.
    for directory in (p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()):
        directory.chmod(0o755)


def _ldconfig(root: Path) -> None:
    """``ldconfig -r root``: the SONAME links and ``root/etc/ld.so.cache``, as the driver's
    installer leaves them."""
    program = next((p for p in _LDCONFIG if Path(p).is_file()), None)
    if program is None:
        raise FakeNvmlBuildError(
            f"no ldconfig (looked for {', '.join(_LDCONFIG)}): the simulated driver root "
            "needs its own ld.so.cache"
        )
    command = [program, "-r", str(root)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_LDCONFIG_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise FakeNvmlBuildError(f"{' '.join(command)}: {error}") from error
    if done.returncode != 0 or not (root / "etc" / "ld.so.cache").is_file():
        raise FakeNvmlBuildError(
            f"{' '.join(command)} failed (exit {done.returncode}; it chroots, so it needs "
            f"root): {done.stderr.strip()}"
        )
