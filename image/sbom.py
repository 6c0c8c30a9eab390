"""Write the agent image's software bill of materials, as CycloneDX 1.6 JSON.

Why from the build's own inputs and not by scanning the image: ``image/build.sh`` knows exactly
what goes in — the Debian base's packages (its dpkg status) and the wheels it installs (the
project's and those of ``requirements.lock``, each checked against the lock's hashes by pip) —
so the SBOM lists those, with each wheel's SHA-256, and needs no scanner in the build.
``tests/image/test_agent_image.py`` checks it against the distributions installed in the image.

    python image/sbom.py --image REF --wheels DIR --dpkg-status FILE --out FILE
"""

from __future__ import annotations

import argparse
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


def bill(image: str, wheels: Path, dpkg_status: str) -> dict[str, Any]:
    """The SBOM document of ``image``."""
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.6",
        "version": 1,
        "metadata": {
            "component": {"type": "container", "name": image},
            "tools": {"components": [{"type": "application", "name": "image/build.sh"}]},
        },
        "components": debian_packages(dpkg_status) + python_wheels(wheels),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True)
    parser.add_argument("--wheels", type=Path, required=True)
    parser.add_argument("--dpkg-status", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    document = bill(args.image, args.wheels, args.dpkg_status.read_text())
    args.out.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
