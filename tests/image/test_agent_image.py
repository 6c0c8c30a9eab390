"""``image/build.sh`` builds the agent's image from this tree with no registry (a Debian base
made by mmdebstrap, ``podman build`` without network), and the image is what the manifests run:
the agent accepts the DaemonSet's arguments, the [agent] extra's libraries import, and no build
tool or package manager for Python or Node.js is left in it, nor any notebook-side package
(issue 35: the agent's runtime comes from ``image/requirements.lock``); the build's SBOM lists
exactly the Python distributions installed in it and the base's Debian packages. Its size is
printed (the figure in docs/performance.md); nothing is timed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.fixtures.requirements import needs_root

from ..manifests.support import by_kind, render
from .agent_image import BUILD_TIMEOUT, AgentImage, agent_image
from .images import REPO, assert_the_sbom_lists_what_the_image_holds, inspect, run

# The images the real node runs: built in .ci/test's real-node lane, never in two lanes at once.
pytestmark = [*needs_root, pytest.mark.slow, pytest.mark.realnode]


@pytest.fixture(scope="module")
def image() -> AgentImage:
    return agent_image()


@pytest.mark.timeout(BUILD_TIMEOUT + 300)
def test_image_runs_the_daemonsets_agent(image: AgentImage) -> None:
    inspected = inspect(image)
    print(f"\nagent image {image.name}: {inspected['Size'] / 2**20:.0f} MiB")
    assert inspected["Config"]["Entrypoint"] == ["jupyter-gpu-hotplug", "agent"]
    assert image.archive.stat().st_size > 0
    (container,) = by_kind(render(), "DaemonSet")["spec"]["template"]["spec"]["containers"]
    resolved: dict[str, Any] = json.loads(
        run(image, *container["args"], "--show-config-json", "--node-name=gpu-node-1")
    )
    assert resolved["backend"] == "kubernetes"


@pytest.mark.timeout(BUILD_TIMEOUT + 300)
def test_image_has_the_agent_extra_and_no_build_tools(image: AgentImage) -> None:
    imports = "import kubernetes, grpc, google.protobuf; import jupyter_gpu_hotplug.agent.runtime"
    run(image, "-c", f"{imports}; from jupyter_gpu_hotplug.agent.kubernetes import backend",
        entrypoint="/opt/gpu-hotplug/bin/python")  # fmt: skip
    present = run(
        image,
        "-c",
        "for tool in node npm yarn gcc cc make pip pip3; do command -v $tool; done; true",
        entrypoint="/bin/sh",
    )
    assert present.split() == []


@pytest.mark.parametrize("directory", ["image", "image/notebook", "image/hub"])
def test_build_script_has_no_registry_step(directory: str) -> None:
    """No FROM of any image's Containerfile names a registry image: the base is the one
    build.sh imports."""
    containerfile = (REPO / directory / "Containerfile").read_text()
    froms = [line.split()[1] for line in containerfile.splitlines() if line.startswith("FROM ")]
    assert froms == ["${BASE}", "${BASE}"]
    assert "ARG BASE=localhost/" in containerfile


@pytest.mark.parametrize("directory", ["image", "image/notebook", "image/hub"])
def test_the_locked_wheels_have_a_layer_before_this_trees_wheel(directory: str) -> None:
    """A rebuild with the same lock reuses the layer where pip installed the locked wheels:
    they are copied and installed before this tree's wheel is copied in."""
    lines = (REPO / directory / "Containerfile").read_text().splitlines()
    deps = lines.index("COPY deps/ /tmp/deps/")
    install = next(i for i, line in enumerate(lines) if "-r /tmp/deps/requirements.lock" in line)
    wheel = lines.index("COPY wheel/ /tmp/wheel/")
    assert deps < install < wheel
    assert not any("wheel/" in line for line in lines[:deps] if not line.startswith("#"))


NOTEBOOK_SIDE = ("jupyter_server", "ipywidgets", "IPython", "jupyter_client", "jupyterlab")
"""The core dependencies only the notebook side imports (issue 35: not in the agent image)."""


@pytest.mark.timeout(BUILD_TIMEOUT + 300)
def test_image_has_no_notebook_side_packages(image: AgentImage) -> None:
    found = run(
        image,
        "-c",
        "import importlib.util as u; "
        f"print(' '.join(m for m in {NOTEBOOK_SIDE!r} if u.find_spec(m)))",
        entrypoint="/opt/gpu-hotplug/bin/python",
    )
    assert found.split() == []


@pytest.mark.timeout(BUILD_TIMEOUT + 300)
def test_the_sbom_lists_what_the_image_holds(image: AgentImage) -> None:
    assert_the_sbom_lists_what_the_image_holds(
        image, "/opt/gpu-hotplug/bin/python", {"python3", "python3-venv", "libc6"}
    )
