"""What ``pip install jupyter-gpu-hotplug`` (plain, and with ``[demo]``) gives a user, from the
built wheel.

The suite's own environment is an editable install, which hides packaging mistakes (a
shared-data mapping that points nowhere, an extension built only in the source tree, an extra
that lacks JupyterLab). Here the wheel is built as a release would be (``python -m build``) and
installed with ``[demo]`` into a clean virtual environment of its own; that environment's own
``jupyter`` commands must list both halves of the extension enabled and OK, and its
``jupyter gpu-hotplug demo`` must start and serve (as root: the demo's kernels run in sandboxes).
The plain wheel, in a second clean environment, must serve the notebook side with none of the
agent's Kubernetes dependencies (the ``[agent]`` extra) installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest

from jupyter_gpu_hotplug import __version__
from tests.demo.demo_process import DemoProcess
from tests.fixtures.agent import free_tcp_port
from tests.fixtures.commands import run_checked
from tests.fixtures.requirements import needs_root

from .test_install import check_labextension, check_server_extension

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT = 600
INSTALL_TIMEOUT = 900


def clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH: the venv must import the wheel, not a source tree."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def run(argv: list[str | Path], timeout: float, cwd: Path | None = None) -> str:
    done = run_checked(argv, timeout=timeout, what=argv, cwd=cwd, env=clean_env())
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built as a release is."""
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--wheel", "--outdir", dist, REPO], BUILD_TIMEOUT)
    (built,) = dist.glob("jupyter_gpu_hotplug-*.whl")
    assert built.name.startswith(f"jupyter_gpu_hotplug-{__version__}-")
    return built


def install(wheel: Path, requirement: str, root: Path) -> Path:
    """A clean venv under ``root`` with ``wheel`` installed as ``requirement``; its ``bin``."""
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    run([bin_dir / "python", "-m", "pip", "install", "-q", requirement], INSTALL_TIMEOUT)
    return bin_dir


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv with the freshly built wheel and its ``[demo]`` extra; its ``bin``."""
    return install(wheel, f"{wheel}[demo]", tmp_path_factory.mktemp("demo"))


@pytest.mark.timeout(BUILD_TIMEOUT + INSTALL_TIMEOUT + 120)
def test_wheel_with_demo_extra_in_a_clean_venv(installed: Path, tmp_path: Path) -> None:
    jupyter = installed / "jupyter"
    check_server_extension(jupyter)
    check_labextension(jupyter)
    # The [demo] extra brought JupyterLab and a kernel; the [hub] extra was not asked for.
    packages = run([installed / "python", "-m", "pip", "list", "--format=freeze"], 120).lower()
    assert "jupyterlab==" in packages and "ipykernel==" in packages
    assert "jupyterhub==" not in packages
    # Local mode's agent (the demo's) needs none of the [agent] extra.
    assert "kubernetes==" not in packages and "grpcio==" not in packages
    assert "--simulate" in run([jupyter, "gpu-hotplug", "demo", "--help"], 120, cwd=tmp_path)
    # What runs is the wheel's copy, not this source tree.
    code = "import jupyter_gpu_hotplug; print(jupyter_gpu_hotplug.__file__)"
    assert str(installed.parent) in run([installed / "python", "-c", code], 60, cwd=tmp_path)


@needs_root
@pytest.mark.timeout(BUILD_TIMEOUT + INSTALL_TIMEOUT + 600)
def test_demo_from_the_wheel_starts_and_serves(installed: Path, tmp_path: Path) -> None:
    state_dir = Path(tempfile.mkdtemp(prefix="gh-wheel-", dir="/tmp"))  # short: a socket path
    demo = DemoProcess.start(
        state_dir,
        notebook_dir=tmp_path / "notebooks",
        port=free_tcp_port(),
        simulate=1,
        output_path=tmp_path / "demo.out",
        jupyter=installed / "jupyter",
    )
    try:
        gpus = demo.server.request("GET", "gpu-hotplug/api/gpus")
        assert gpus.status == 200, gpus
        assert (gpus.body["total"], gpus.body["simulated"]) == (1, True)
        assert demo.interrupt() == 0, demo.logs()
    finally:
        demo.kill_everything()
        shutil.rmtree(state_dir, ignore_errors=True)


# Run inside the plain wheel's venv: every module a notebook image loads (the server extension,
# the kernel's magic and widget, the client, the spawner helpers, the CLI, local mode) imports,
# and the Kubernetes agent's libraries are absent.
_IMPORT_NOTEBOOK_SIDE = """
import importlib, importlib.util, json, pkgutil
import jupyter_gpu_hotplug as package
absent = [n for n in ("kubernetes", "grpc", "google.protobuf")
          if importlib.util.find_spec(n.split(".")[0]) is None
          or importlib.util.find_spec(n) is None]
imported = []
for module in pkgutil.walk_packages(package.__path__, "jupyter_gpu_hotplug."):
    if not module.name.startswith("jupyter_gpu_hotplug.agent.kubernetes"):
        importlib.import_module(module.name)
        imported.append(module.name)
print(json.dumps({"absent": absent, "imported": imported, "file": package.__file__}))
"""

NOTEBOOK_SIDE = {
    "jupyter_gpu_hotplug.server.app",
    "jupyter_gpu_hotplug.server.handlers",
    "jupyter_gpu_hotplug.kernel.magic",
    "jupyter_gpu_hotplug.kernel.widget",
    "jupyter_gpu_hotplug.client",
    "jupyter_gpu_hotplug.spawner.kube",
    "jupyter_gpu_hotplug.spawner.docker",
    "jupyter_gpu_hotplug.cli",
}


@pytest.mark.timeout(BUILD_TIMEOUT + INSTALL_TIMEOUT + 120)
def test_plain_wheel_serves_the_notebook_side_without_the_agent_extra(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    bin_dir = install(wheel, str(wheel), tmp_path_factory.mktemp("plain"))
    packages = run([bin_dir / "python", "-m", "pip", "list", "--format=freeze"], 120).lower()
    for dependency in ("kubernetes", "grpcio", "protobuf"):
        assert f"\n{dependency}==" not in f"\n{packages}", dependency
    report = json.loads(run([bin_dir / "python", "-c", _IMPORT_NOTEBOOK_SIDE], 300, cwd=tmp_path))
    assert report["absent"] == ["kubernetes", "grpc", "google.protobuf"]
    assert set(report["imported"]) >= NOTEBOOK_SIDE
    assert report["file"].startswith(str(bin_dir.parent)), report["file"]
    check_server_extension(bin_dir / "jupyter")
    # Kubernetes mode without the extra says what to install, and starts nothing.
    refused = subprocess.run(
        [bin_dir / "jupyter-gpu-hotplug", "agent", "--backend=kubernetes", "--listen=127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
        env={**clean_env(), "NODE_NAME": "gpu-node-1"},
    )
    assert refused.returncode != 0
    assert "pip install 'jupyter-gpu-hotplug[agent]'" in refused.stdout + refused.stderr
