"""The systemd node's VM image: built from Debian packages with ``mmdebstrap``, cached.

Why a cache keyed by the recipe: a cold build takes minutes of a shared 2-core machine, and the
image only changes when its recipe (``image/build.sh``, ``image/hooks.sh``, the suite) does. The
cache lives under ``~/.cache/jupyter-gpu-hotplug/vm/<key>/`` (``$GPU_HOTPLUG_CACHE_DIR`` moves
the root, as for the simulated NVML), is filled in a temporary directory and renamed into place
only when complete, and is guarded by a lock so that two sessions never build it twice. Nothing
ever writes the cached image afterwards: the VM boots it with ``snapshot=on``.

The Debian mirror is the host's own (its apt sources): no other network source is used.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from jupyter_gpu_hotplug.nvml.sim.build import default_cache_dir

__all__ = ["HOST_TOOLS", "SUITE", "Image", "ImageUnavailable", "ensure_image", "recipe_key"]

SUITE: Final = "bookworm"
"""Debian 12: systemd 252, whose ``daemon-reload`` re-attaches its device program every time
(on 257 it depends on the trigger), containerd 1.6, runc 1.1, podman 4.3, crun 1.8."""

RECIPE_DIR: Final = Path(__file__).parent / "image"
BUILD_TIMEOUT: Final = 1800.0
"""A cold build is 2-5 minutes here; the bound only catches a hung mirror."""
HOST_TOOLS: Final = ("mmdebstrap", "mkfs.ext4", "ssh", "ssh-keygen", "qemu-system-x86_64")
"""What the host needs (``.ci/setup --with-vm`` installs it)."""
_APT_SOURCES: Final = (Path("/etc/apt/sources.list.d"), Path("/etc/apt/sources.list"))


class ImageUnavailable(Exception):
    """The image cannot be built here (no root, a tool or the mirror missing, build failed)."""


@dataclass(frozen=True)
class Image:
    """A complete cached image."""

    directory: Path
    key: str

    @property
    def rootfs(self) -> Path:
        return self.directory / "rootfs.ext4"

    @property
    def kernel(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.img"

    @property
    def ssh_key(self) -> Path:
        return self.directory / "id_ed25519"


def recipe_key(suite: str = SUITE) -> str:
    """Hex digest of every recipe file's name and content, and the suite."""
    digest = hashlib.sha256(suite.encode())
    for path in sorted(RECIPE_DIR.iterdir()):
        digest.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def host_mirrors(sources: tuple[Path, ...] = _APT_SOURCES) -> tuple[str, str]:
    """The Debian mirror and its security archive, as the host's apt sources name them.

    Both deb822 (``URIs:``) and one-line (``deb URI suite``) sources are read; the security
    archive is the one whose URI ends in ``-security``, else the mirror's sibling.
    """
    uris: list[str] = []
    files = [p for s in sources for p in (sorted(s.glob("*")) if s.is_dir() else [s])]
    for path in files:
        if not path.is_file() or path.suffix not in {".sources", ".list"}:
            continue
        text = path.read_text()
        uris += re.findall(r"^URIs:\s*(\S+)", text, re.MULTILINE)
        uris += re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.MULTILINE)
    main = next((u for u in uris if not u.rstrip("/").endswith("-security")), None)
    if main is None:
        raise ImageUnavailable(
            f"no Debian mirror in the apt sources ({', '.join(map(str, files))})"
        )
    security = next(
        (u for u in uris if u.rstrip("/").endswith("-security")),
        main.rstrip("/").removesuffix("/debian") + "/debian-security",
    )
    return main, security


def missing_host_tools() -> list[str]:
    return [tool for tool in HOST_TOOLS if shutil.which(tool) is None]


def ensure_image(cache_root: Path | None = None, *, suite: str = SUITE) -> Image:
    """The cached image for the current recipe, built first if it is missing.

    Raises :class:`ImageUnavailable` with what to do when it cannot be built here.
    """
    key = recipe_key(suite)
    root = (cache_root or default_cache_dir()) / "vm"
    image = Image(root / key, key)
    if image.rootfs.is_file():
        return image
    if os.geteuid() != 0:
        raise ImageUnavailable("building the VM image needs root (mmdebstrap, mkfs)")
    if missing := missing_host_tools():
        raise ImageUnavailable(
            f"missing host tools {missing}: run `bash .ci/setup --with-vm` (Debian packages "
            "mmdebstrap, qemu-system-x86, qemu-utils, e2fsprogs, openssh-client)"
        )
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building the same key
        if not image.rootfs.is_file():
            _build(image, suite)
    return image


def _build(image: Image, suite: str) -> None:
    mirror, security = host_mirrors()
    scratch = Path(tempfile.mkdtemp(prefix=f".build-{image.key}-", dir=image.directory.parent))
    started = time.monotonic()
    try:
        result = subprocess.run(
            [
                "nice",
                "-n",
                "10",
                "bash",
                str(RECIPE_DIR / "build.sh"),
                str(scratch),
                mirror,
                security,
                suite,
            ],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
        if result.returncode != 0:
            raise ImageUnavailable(
                f"the VM image build failed (exit {result.returncode}):\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
            )
        (scratch / "build-seconds").write_text(f"{time.monotonic() - started:.0f}\n")
        scratch.rename(image.directory)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
