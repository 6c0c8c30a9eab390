"""The project's images, built by ``image/build.sh --image KIND`` (the one way to build them)
for the tests that run them: the agent's (``agent_image.py``), the notebook's and the hub's
(``hub_images.py``). One builder, parametrised by the kind.

Podman never uses the machine's storage here. The agent's image is built in a directory of its
own, removed with ``podman system reset`` when the process ends, as it always was. The notebook
and hub images are built in storage kept under the image cache (``$JGH_IMAGE_CACHE/podman-<kind>``,
beside ``build.sh``'s base tarballs and wheels), so that a later session with the same lock
reuses the layer of the locked wheels and rebuilds only the layer of this tree's wheel: their
dependencies are ten times the agent's. Their archives are written per session and removed at
its end.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from tests.fixtures.commands import run_checked

REPO: Final = Path(__file__).resolve().parents[2]
BUILD_SCRIPT: Final = REPO / "image" / "build.sh"
BUILD_TIMEOUT: Final = 1800
"""A cold build runs mmdebstrap and builds the wheel with its JupyterLab extension."""

Kind = Literal["agent", "notebook", "hub"]


@dataclass(frozen=True)
class BuiltImage:
    name: str
    """The image's reference (``localhost/jupyter-gpu-hotplug-<kind>:<version>``)."""
    archive: Path
    """An OCI archive of it, for ``ctr images import`` or ``podman load``."""
    sbom: Path
    """Its SBOM (CycloneDX JSON), written by the build beside the archive."""
    podman: tuple[str, ...]
    """``podman`` with this build's storage options, to run or inspect the image."""


def image_cache() -> Path:
    """``build.sh``'s cache directory (``$JGH_IMAGE_CACHE``, the same default)."""
    default = Path.home() / ".cache" / "jupyter-gpu-hotplug" / "image"
    return Path(os.environ.get("JGH_IMAGE_CACHE") or default)


def podman_in(root: Path, runroot: Path) -> tuple[str, ...]:
    """``podman`` with its images under ``root`` and its run state under ``runroot``."""
    # runc: crun refuses this machine's hybrid cgroups (docs/testing.md).
    return ("podman", "--root", str(root), "--runroot", str(runroot), "--runtime", "runc")


def _session_directory(prefix: str) -> Path:
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


@functools.cache
def tree_wheel() -> Path:
    """This tree's wheel (with its JupyterLab extension), built once per session for every
    image (``build.sh --wheel``): a build takes a quarter of a warm image build."""
    out = _session_directory("jgh-wheel-")
    run_checked(
        [sys.executable, "-m", "build", "--wheel", "--outdir", out, REPO],
        timeout=BUILD_TIMEOUT,
        what="python -m build failed",
    )
    (wheel,) = out.glob("jupyter_gpu_hotplug-*.whl")
    return wheel


def build_image(kind: Kind, podman: tuple[str, ...], archive: Path) -> BuiltImage:
    """Run ``image/build.sh --image KIND`` with ``podman``'s storage, saving ``archive``."""
    done = run_checked(
        ["bash", BUILD_SCRIPT, "--image", kind, "--save", archive, "--wheel", tree_wheel()],
        timeout=BUILD_TIMEOUT,
        what=f"image/build.sh --image {kind} failed",
        env={**os.environ, "PODMAN": " ".join(podman), "PYTHON": sys.executable},
    )
    return BuiltImage(
        name=done.stdout.split()[-1],
        archive=archive,
        sbom=archive.with_name(archive.name + ".cdx.json"),
        podman=podman,
    )


def build_in_private_storage(kind: Kind) -> BuiltImage:
    """Build in podman storage of this session's own, reset and removed when it ends."""
    storage = _session_directory(f"jgh-{kind}-image-")
    podman = podman_in(storage / "root", storage / "run")
    atexit.register(
        subprocess.run, [*podman, "system", "reset", "--force"], capture_output=True, check=False
    )
    return build_image(kind, podman, storage / f"{kind}.oci.tar")


def build_in_kept_storage(kind: Kind) -> BuiltImage:
    """Build in podman storage kept under the image cache between sessions (see above)."""
    storage = image_cache() / f"podman-{kind}"
    # podman's database records the runroot it was made with and refuses any other, and a
    # runroot may have at most 50 characters: a fixed short path under /tmp, one per storage
    # (its run state is the machine's to forget at a reboot, as /run's is).
    root = storage / "root"
    runroot = Path("/tmp") / f"jgh-podman-{kind}-{hashlib.sha256(bytes(root)).hexdigest()[:8]}"
    podman = podman_in(root, runroot)
    archive = _session_directory(f"jgh-{kind}-image-") / f"{kind}.oci.tar"
    return build_image(kind, podman, archive)


def run(image: BuiltImage, *argv: str, entrypoint: str | None = None) -> str:
    """``podman run`` of the image with no network, as ENVIRONMENT.md says podman runs here;
    its standard output."""
    options = ["--rm", "--network", "none"]
    options += ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
    if entrypoint is not None:
        options += ["--entrypoint", entrypoint]
    return run_checked(
        [*image.podman, "run", *options, image.name, *argv], timeout=300, what=argv
    ).stdout


def inspect(image: BuiltImage) -> dict[str, Any]:
    """``podman image inspect`` of the image."""
    found: list[dict[str, Any]] = json.loads(
        run_checked(
            [*image.podman, "image", "inspect", image.name], timeout=120, what="podman inspect"
        ).stdout
    )
    return found[0]


def assert_the_sbom_lists_what_the_image_holds(
    image: BuiltImage, python: str, debian: set[str], npm_lock: str | None = None
) -> None:
    """The build's SBOM (CycloneDX 1.6) lists exactly the Python distributions that
    ``python`` in the image sees (each wheel with its SHA-256), the base's Debian packages,
    ``debian`` among them, and exactly the npm packages of the image's ``npm_lock`` (the
    ``node_modules/.package-lock.json`` that ``npm ci`` wrote), each with its integrity hash."""
    sbom = json.loads(image.sbom.read_text())
    assert (sbom["bomFormat"], sbom["specVersion"]) == ("CycloneDX", "1.6")
    assert sbom["metadata"]["component"]["name"] == image.name

    def listed(kind: str) -> list[dict[str, Any]]:
        return [c for c in sbom["components"] if c["purl"].startswith(f"pkg:{kind}/")]

    installed = run(
        image,
        "-c",
        "import importlib.metadata as m, re; "
        "print('\\n'.join(re.sub(r'[-_.]+', '-', d.metadata['Name']).lower() + ' ' + d.version "
        "for d in m.distributions()))",
        entrypoint=python,
    )
    wheels = listed("pypi")
    assert {tuple(line.split()) for line in installed.splitlines()} == {
        (c["name"], c["version"]) for c in wheels
    }
    assert all(len(c["hashes"][0]["content"]) == 64 for c in wheels)
    assert debian <= {c["name"] for c in listed("deb")}
    npm = listed("npm")
    if npm_lock is None:
        assert npm == []
        return
    packages = json.loads(run(image, npm_lock, entrypoint="/bin/cat"))["packages"]
    assert {(c["name"], c["version"]) for c in npm} == {
        (path.rsplit("node_modules/", 1)[1], package["version"])
        for path, package in packages.items()
    }
    assert all(c["hashes"][0]["alg"] == "SHA-512" for c in npm)
