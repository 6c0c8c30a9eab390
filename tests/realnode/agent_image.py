"""The agent's container image, built from this repository with no registry and no image builder:
a Debian base made by ``mmdebstrap`` (Debian's ``python3`` and a virtual environment with the
package's declared dependencies from PyPI) and a layer with the wheel built from this tree,
written as an OCI image-layout tarball that ``ctr images import`` (or ``podman load``) takes.

    python -m tests.realnode.agent_image [--output DIR]    # prints the archive and image name

Why a script and not a Containerfile: no registry is reachable here (no ``FROM`` image to pull)
and an image builder is not needed for two layers. The layers are cached under
``~/.cache/jupyter-gpu-hotplug/agent-image/`` keyed by what they are made of: the base by the
Debian suite, its packages and the dependency list in ``pyproject.toml`` (minutes, rarely
rebuilt), the wheel's layer by the package's tracked sources (seconds). Root is needed
(``mmdebstrap`` in root mode).

The image: ``/opt/gpu-hotplug`` is the virtual environment; the entrypoint is the agent
(``python -m jupyter_gpu_hotplug.agent.app``), so a DaemonSet gives only its arguments, as
``k8s/base/daemonset.yaml`` does.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..k8s.image import LAYER_MEDIA, image_blobs, write_layout

REPO: Final = Path(__file__).resolve().parents[2]
IMAGE_NAME: Final = "localhost/jupyter-gpu-hotplug-agent:test"
SUITE: Final = "bookworm"
MIRROR: Final = "http://deb.debian.org/debian"
PACKAGES: Final = ("python3", "python3-venv")
VENV: Final = "/opt/gpu-hotplug"
PYTHON: Final = f"{VENV}/bin/python"
ENTRYPOINT: Final = (PYTHON, "-m", "jupyter_gpu_hotplug.agent.app")
CACHE_ENV: Final = "JGH_IMAGE_CACHE"
BUILD_TIMEOUT: Final = 1800


@dataclass(frozen=True)
class AgentImage:
    """A built image: its name (as the DaemonSet names it) and its OCI archive."""

    name: str
    archive: Path


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache/jupyter-gpu-hotplug/agent-image")


def _dependencies() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def _key(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()[:16]


def _run(argv: list[str], env: dict[str, str] | None = None) -> None:
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}):\n{done.stderr[-4000:]}")


def base_layer() -> Path:
    """Debian ``SUITE`` with ``python3`` and a venv holding the package's dependencies."""
    dependencies = _dependencies()
    key = _key(SUITE.encode(), " ".join(PACKAGES).encode(), "\n".join(dependencies).encode())
    layer = cache_dir() / f"base-{key}.tar"
    if layer.exists():
        return layer
    if shutil.which("mmdebstrap") is None:
        raise RuntimeError("mmdebstrap is missing: apt-get install mmdebstrap")
    layer.parent.mkdir(parents=True, exist_ok=True)
    partial = layer.with_suffix(".partial")
    # The dependencies are installed by this machine's pip (same Python 3.11 and glibc as the
    # base's), which is set up for this network (its proxy's certificate authority).
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir"]
    site = f'"$1{VENV}/lib/{_python_dir()}/site-packages"'
    _run(
        [
            "mmdebstrap",
            "--mode=root",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            f'--customize-hook=chroot "$1" python3 -m venv --without-pip {VENV}',
            f"--customize-hook={' '.join(shlex.quote(a) for a in pip)} --target={site} "
            + " ".join(shlex.quote(d) for d in dependencies),
            "--format=tar",
            SUITE,
            str(partial),
            MIRROR,
        ]
    )
    partial.rename(layer)
    return layer


def _sources_key() -> str:
    files = subprocess.run(
        ["git", "ls-files", "-z", "jupyter_gpu_hotplug", "pyproject.toml"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    parts = [name + b"\0" + (REPO / name.decode()).read_bytes() for name in files if name]
    return _key(*parts)


def app_layer() -> Path:
    """The wheel built from this tree, installed (no dependencies) into the venv."""
    layer = cache_dir() / f"app-{_sources_key()}.tar"
    if layer.exists():
        return layer
    layer.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jgh-image-") as work:
        dist, root = Path(work, "dist"), Path(work, "root")
        _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(REPO)])
        (wheel,) = dist.glob("jupyter_gpu_hotplug-*.whl")
        site = root / VENV.lstrip("/") / "lib" / _python_dir() / "site-packages"
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-compile",
                f"--target={site}",
                str(wheel),
            ]
        )
        partial = layer.with_suffix(".partial")
        with tarfile.open(partial, "w") as archive:
            archive.add(root / "opt", arcname="opt")
        partial.rename(layer)
    return layer


def _python_dir() -> str:
    """The base's Python (Debian bookworm's 3.11) names the venv's site-packages directory."""
    return "python3.11"


def _file_blob(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest(), path.stat().st_size


def write_archive(path: Path, layers: list[Path], name: str = IMAGE_NAME) -> AgentImage:
    """An OCI image-layout tarball of ``layers`` (uncompressed tars, bottom first)."""
    described = [_file_blob(layer) for layer in layers]
    descriptor, blobs = image_blobs(
        name,
        [{"mediaType": LAYER_MEDIA, "digest": d, "size": s} for d, s in described],
        entrypoint=list(ENTRYPOINT),
        cmd=None,
        env=[f"PATH={VENV}/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    )
    with tarfile.open(path, "w") as archive:
        write_layout(archive, [descriptor], blobs)
        for layer, (digest, _) in zip(layers, described, strict=True):
            archive.add(layer, arcname=f"blobs/sha256/{digest.removeprefix('sha256:')}")
    return AgentImage(name, path)


def agent_image(output: Path | None = None) -> AgentImage:
    """Build (or reuse) both layers and write the image's archive (in the cache by default)."""
    layers = [base_layer(), app_layer()]
    target = output or cache_dir() / f"agent-{_key(*(p.name.encode() for p in layers))}.oci.tar"
    if not target.exists():
        partial = target.with_suffix(".partial")
        write_archive(partial, layers)
        partial.rename(target)
    return AgentImage(IMAGE_NAME, target)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.realnode.agent_image", description=__doc__
    )
    parser.add_argument("--output", type=Path, help="where to write the OCI archive")
    args = parser.parse_args()
    image = agent_image(args.output)
    print(f"{image.name} {image.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
