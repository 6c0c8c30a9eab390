"""``image/build.sh --image hub`` builds JupyterHub's image from this tree with no registry (the
Debian base with Debian's nodejs), for both pods of a hub on Kubernetes (issue 34): JupyterHub
with KubeSpawner and this project's spawner helpers, and configurable-http-proxy at the version
``image/hub/package.json`` pins, run as uid 1000 with no network. Its SBOM lists what it holds,
configurable-http-proxy's npm packages too. Its size is printed; nothing is timed.
"""

from __future__ import annotations

import json

import pytest

from tests.fixtures.requirements import needs_root

from .hub_images import BUILD_TIMEOUT, BuiltImage, hub_image
from .images import REPO, assert_the_sbom_lists_what_the_image_holds, inspect, run

# The images the real node runs: built in .ci/test's real-node lane, never in two lanes at once.
pytestmark = [
    *needs_root,
    pytest.mark.slow,
    pytest.mark.realnode,
    pytest.mark.timeout(BUILD_TIMEOUT + 300),
]


@pytest.fixture(scope="module")
def image() -> BuiltImage:
    return hub_image()


def _locked_version(name: str) -> str:
    for line in (REPO / "image" / "hub" / "requirements.lock").read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==")[1].split()[0]
    raise AssertionError(f"{name} is not in image/hub/requirements.lock")


def test_the_image_runs_jupyterhub_and_the_proxy_as_uid_1000(image: BuiltImage) -> None:
    inspected = inspect(image)
    print(f"\nhub image {image.name}: {inspected['Size'] / 2**20:.0f} MiB")
    assert image.archive.stat().st_size > 0
    assert inspected["Config"]["User"] == "1000:1000"
    proxy = json.loads((REPO / "image" / "hub" / "package.json").read_text())
    found = run(
        image,
        "-c",
        "id -u; jupyterhub --version; configurable-http-proxy --version; "
        "touch written && echo writable",
        entrypoint="/bin/sh",
    )
    assert found.split() == [
        "1000",
        _locked_version("jupyterhub"),
        proxy["dependencies"]["configurable-http-proxy"],
        "writable",
    ]


def test_the_spawner_helpers_and_kubespawner_import(image: BuiltImage) -> None:
    found = run(
        image,
        "-c",
        "from jupyter_gpu_hotplug.spawner import configure_kubespawner; import kubespawner; "
        "from importlib.metadata import version; print(version('jupyterhub-kubespawner'))",
        entrypoint="python",
    )
    assert found.split() == [_locked_version("jupyterhub-kubespawner")]


def test_the_sbom_lists_what_the_image_holds(image: BuiltImage) -> None:
    assert_the_sbom_lists_what_the_image_holds(
        image,
        "/opt/hub/bin/python",
        {"python3", "python3-venv", "nodejs", "libc6"},
        npm_lock="/opt/chp/node_modules/.package-lock.json",
    )
