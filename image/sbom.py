"""Write an image's software bill of materials, as CycloneDX 1.6 JSON.

Why from the build's own inputs and not by scanning the image: ``image/build.sh`` knows exactly
what goes in — the Debian base's packages (its dpkg status), the wheels it installs (the
project's and those of the image's ``requirements.lock``, each checked against the lock's hashes
by pip) and, in the hub's image, the npm packages of configurable-http-proxy — so the SBOM lists
those, with each file's hash, and needs no scanner in the build. ``tests/image/test_*_image.py``
check it against what is installed in each image.

    python image/sbom.py --image REF --wheels DIR [--wheels DIR ...] --dpkg-status FILE \
        [--npm-lock node_modules/.package-lock.json] --out FILE
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any

_DEBIAN_SUITE = "bookworm"


def debian_packages(status: str) -> list[dict[str, Any]]:
    """The installed packages of a dpkg status file, as CycloneDX components."""
    components = []
    for stanza in status.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " "
        )
        if fields.get("Status") != "install ok installed":
            continue
        name, version, arch = fields["Package"], fields["Version"], fields["Architecture"]
        components.append(
            {
                "type": "library",
                "name": name,
                "version": version,
                "purl": f"pkg:deb/debian/{name}@{version}?arch={arch}&distro={_DEBIAN_SUITE}",
            }
        )
    return components


def python_wheels(directory: Path) -> list[dict[str, Any]]:
    """Every wheel in ``directory`` (name and version from its file name, PEP 427), with its
    SHA-256, as CycloneDX components."""
    components = []
    for wheel in sorted(directory.glob("*.whl")):
        distribution, version = wheel.name.split("-")[:2]
        name = re.sub(r"[-_.]+", "-", distribution).lower()
        components.append(
            {
                "type": "library",
                "name": name,
                "version": version,
                "purl": f"pkg:pypi/{name}@{version}",
                "hashes": [
                    {"alg": "SHA-256", "content": hashlib.sha256(wheel.read_bytes()).hexdigest()}
                ],
            }
        )
    return components


def npm_packages(lock: dict[str, Any]) -> list[dict[str, Any]]:
    """The packages an npm lock file lists (``npm ci`` writes ``node_modules/.package-lock.json``
    with exactly those it installed), each with its integrity hash, as CycloneDX components."""
    components = []
    for path, package in sorted(lock["packages"].items()):
        if not path:
            continue  # the root project itself
        name = path.rsplit("node_modules/", 1)[1]
        algorithm, digest = package["integrity"].split("-", 1)
        components.append(
            {
                "type": "library",
                "name": name,
                "version": package["version"],
                "purl": f"pkg:npm/{name.replace('@', '%40')}@{package['version']}",
                "hashes": [
                    {
                        "alg": algorithm.upper().replace("SHA", "SHA-"),
                        "content": base64.b64decode(digest).hex(),
                    }
                ],
            }
        )
    return components


def bill(
    image: str, wheels: list[Path], dpkg_status: str, npm_lock: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The SBOM document of ``image``."""
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.6",
        "version": 1,
        "metadata": {
            "component": {"type": "container", "name": image},
            "tools": {"components": [{"type": "application", "name": "image/build.sh"}]},
        },
        "components": debian_packages(dpkg_status)
        + [component for directory in wheels for component in python_wheels(directory)]
        + (npm_packages(npm_lock) if npm_lock is not None else []),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True)
    parser.add_argument("--wheels", type=Path, action="append", required=True)
    parser.add_argument("--dpkg-status", type=Path, required=True)
    parser.add_argument("--npm-lock", type=Path, help="node_modules/.package-lock.json")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    npm_lock = json.loads(args.npm_lock.read_text()) if args.npm_lock else None
    document = bill(args.image, args.wheels, args.dpkg_status.read_text(), npm_lock)
    args.out.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
