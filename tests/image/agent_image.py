"""The agent's image, built by ``image/build.sh`` (the one way to build it) for tests that run
it: its own test here and the real node's deployment test, which imports the archive into the
node's containerd.

Podman keeps this build's storage in a directory of its own (never the machine's), removed with
``podman system reset`` when the process ends; the Debian base's tarball stays cached by
``build.sh``.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tests.fixtures.commands import run_checked

REPO: Final = Path(__file__).resolve().parents[2]
BUILD_SCRIPT: Final = REPO / "image" / "build.sh"
BUILD_TIMEOUT: Final = 1800
"""A cold build runs mmdebstrap and builds the wheel with its JupyterLab extension."""


@dataclass(frozen=True)
class AgentImage:
    name: str
    """The image's reference (``localhost/jupyter-gpu-hotplug-agent:<version>``)."""
    archive: Path
    """An OCI archive of it, for ``ctr images import`` or ``podman load``."""
    sbom: Path
    """Its SBOM (CycloneDX JSON), written by the build beside the archive."""
    podman: tuple[str, ...]
    """``podman`` with this build's storage options, to run or inspect the image."""


def _podman(storage: Path) -> tuple[str, ...]:
    # runc: crun refuses this machine's hybrid cgroups (docs/testing.md).
    return ("podman", "--root", str(storage / "root"), "--runroot", str(storage / "run"),
            "--runtime", "runc")  # fmt: skip


def build_agent_image(storage: Path) -> AgentImage:
    """Run ``image/build.sh`` with podman storage under ``storage``."""
    podman = _podman(storage)
    archive = storage / "agent.oci.tar"
    done = run_checked(
        ["bash", BUILD_SCRIPT, "--save", archive],
        timeout=BUILD_TIMEOUT,
        what="image/build.sh failed",
        env={**os.environ, "PODMAN": " ".join(podman), "PYTHON": sys.executable},
    )
    return AgentImage(
        name=done.stdout.split()[-1],
        archive=archive,
        sbom=archive.with_name(archive.name + ".cdx.json"),
        podman=podman,
    )


def _remove(storage: Path) -> None:
    subprocess.run(
        [*_podman(storage), "system", "reset", "--force"], capture_output=True, check=False
    )
    shutil.rmtree(storage, ignore_errors=True)


@functools.cache
def agent_image() -> AgentImage:
    """The image of this source tree, built once per test session."""
    storage = Path(tempfile.mkdtemp(prefix="jgh-agent-image-", dir="/tmp"))
    atexit.register(_remove, storage)
    return build_agent_image(storage)
