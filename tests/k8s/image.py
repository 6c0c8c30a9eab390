"""The test image: busybox-static's binary as a one-layer OCI image, written with no registry.

Why: no registry is reachable on CI, yet the kubelet simulator must run real containers. An
OCI image layout tarball is all ``ctr images import`` needs. One layer (uncompressed, so its
digest is also its diff id) carries ``/bin/busybox`` and symlinks for the applets tests use;
two image configs over it give the sandbox ("pause") image, whose default process waits for
ever and exits on SIGTERM (as the real pause does: a stopped pod's sandbox and holder end at
once instead of after their grace period), and a general image whose command the pod spec sets.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

BUSYBOX: Final = Path("/bin/busybox")
"""Debian's ``busybox-static``: statically linked, so the image needs no libraries."""

PAUSE_IMAGE: Final = "localhost/k8stier/pause:1"
"""Sandbox (pause) image, and what pods without a command run: ``PAUSE_COMMAND``."""
PAUSE_COMMAND: Final = ("/bin/sh", "-c", "trap 'exit 0' TERM INT; sleep infinity & wait")
"""What the pause image runs. A shell as PID 1 is sent SIGTERM only because it traps it (the
kernel drops signals without a handler to a namespace's init, so a bare ``sleep`` would wait
out the grace period); ``wait`` returns on the signal."""
TOOLS_IMAGE: Final = "localhost/k8stier/busybox:1"
"""Same layer, default command ``sh``: pods that give a command run it here."""

APPLETS: Final = (
    "[", "cat", "cut", "echo", "env", "false", "grep", "head", "id", "kill", "ls", "mkdir",
    "mknod", "nc", "printf", "ps", "readlink", "rm", "sh", "sleep", "stat", "test", "touch",
    "tr", "true", "wc", "wget",
)  # fmt: skip
"""Applets linked into ``/bin``: what a pod's command or an exec in a test may call."""

PLATFORM: Final = {"architecture": "amd64", "os": "linux"}
"""Named in the index: containerd 2 unpacks an imported image only for a platform it names."""
LAYER_MEDIA: Final = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA: Final = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA: Final = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA: Final = "application/vnd.oci.image.index.v1+json"


@dataclass(frozen=True)
class Blob:
    """A small content-addressed blob of an OCI layout (a config, a manifest, a layer)."""

    data: bytes
    media_type: str

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        return {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": len(self.data),
            **extra,
        }


def add_member(
    archive: tarfile.TarFile, name: str, data: bytes | None = None, **attrs: Any
) -> None:
    info = tarfile.TarInfo(name)
    info.mode = attrs.pop("mode", 0o644)
    info.size = len(data or b"")
    for key, value in attrs.items():
        setattr(info, key, value)
    archive.addfile(info, io.BytesIO(data) if data is not None else None)


def _static_busybox() -> bytes:
    """``/bin/busybox``, refused unless statically linked (the image has no libraries)."""
    if not BUSYBOX.exists():
        raise RuntimeError(f"{BUSYBOX} is missing: apt-get install busybox-static")
    binary = BUSYBOX.read_bytes()
    if b"ld-linux" in binary[:4096]:  # a dynamic ELF names its interpreter up front
        raise RuntimeError(f"{BUSYBOX} is dynamically linked: apt-get install busybox-static")
    return binary


def _layer() -> Blob:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as layer:
        # Mount points runc and the CRI plugin expect to exist in the rootfs.
        for directory in ("bin", "dev", "etc", "proc", "sys", "tmp"):
            add_member(layer, directory, type=tarfile.DIRTYPE, mode=0o755)
        add_member(layer, "bin/busybox", _static_busybox(), mode=0o755)
        for applet in APPLETS:
            add_member(layer, f"bin/{applet}", type=tarfile.SYMTYPE, linkname="busybox", mode=0o777)
    return Blob(buffer.getvalue(), LAYER_MEDIA)


def image_blobs(
    name: str,
    layers: list[dict[str, Any]],
    *,
    entrypoint: list[str] | None,
    cmd: list[str] | None,
    env: list[str],
) -> tuple[dict[str, Any], list[Blob]]:
    """The config and manifest of image ``name`` over ``layers`` (descriptors of uncompressed
    layers, bottom first, whose digests are also their diff ids), and its index entry."""
    config = Blob(
        json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Env": env, "Entrypoint": entrypoint, "Cmd": cmd, "WorkingDir": "/"},
                "rootfs": {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]},
            }
        ).encode(),
        CONFIG_MEDIA,
    )
    manifest = Blob(
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST_MEDIA,
                "config": config.descriptor(),
                "layers": layers,
            }
        ).encode(),
        MANIFEST_MEDIA,
    )
    # `ctr images import` names the image after this annotation (the ref.name alone would need
    # --base-name).
    annotations = {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": "1"}
    return manifest.descriptor(annotations=annotations, platform=PLATFORM), [config, manifest]


def write_layout(
    archive: tarfile.TarFile, manifests: list[dict[str, Any]], blobs: list[Blob]
) -> None:
    """The OCI layout's marker, its index of ``manifests`` and the small ``blobs``."""
    index = {"schemaVersion": 2, "mediaType": INDEX_MEDIA, "manifests": manifests}
    add_member(archive, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
    add_member(archive, "index.json", json.dumps(index).encode())
    for blob in {b.digest: b for b in blobs}.values():
        add_member(archive, f"blobs/sha256/{blob.digest.removeprefix('sha256:')}", blob.data)


def write_oci_archive(path: Path) -> tuple[str, ...]:
    """Write both test images as one OCI image-layout tarball; returns their names."""
    layer = _layer()
    blobs = [layer]
    manifests = []
    for name, entrypoint, cmd in (
        (PAUSE_IMAGE, list(PAUSE_COMMAND), None),
        (TOOLS_IMAGE, None, ["/bin/sh"]),
    ):
        descriptor, image = image_blobs(
            name, [layer.descriptor()], entrypoint=entrypoint, cmd=cmd, env=["PATH=/bin"]
        )
        manifests.append(descriptor)
        blobs.extend(image)
    with tarfile.open(path, "w") as archive:
        write_layout(archive, manifests, blobs)
    return PAUSE_IMAGE, TOOLS_IMAGE
