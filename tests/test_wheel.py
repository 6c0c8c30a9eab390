"""What ``pip install 'jupyter-gpu-hotplug[demo]'`` gives a user, from the built wheel.

The suite's own environment is an editable install, which hides packaging mistakes (a
shared-data mapping that points nowhere, an extension built only in the source tree, an extra
that lacks JupyterLab). Here the wheel is built as a release would be (``python -m build``) and
installed with ``[demo]`` into a clean virtual environment of its own; that environment's own
``jupyter`` commands must list both halves of the extension enabled and OK, and its
``jupyter gpu-hotplug demo`` must start and serve (as root: the demo's kernels run in sandboxes).
"""

from __future__ import annotations

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
from tests.fixtures.requirements import needs_root

from .test_install import check_labextension, check_server_extension

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT = 600
INSTALL_TIMEOUT = 900


def run(argv: list[str | Path], timeout: float, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(arg) for arg in argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        check=False,
    )
    assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv with the freshly built wheel and its ``[demo]`` extra; its ``bin``."""
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    run([sys.executable, "-m", "build", "--wheel", "--outdir", dist, REPO], BUILD_TIMEOUT)
    (wheel,) = dist.glob("jupyter_gpu_hotplug-*.whl")
    assert wheel.name.startswith(f"jupyter_gpu_hotplug-{__version__}-")
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    run([bin_dir / "python", "-m", "pip", "install", "-q", f"{wheel}[demo]"], INSTALL_TIMEOUT)
    return bin_dir


@pytest.mark.timeout(BUILD_TIMEOUT + INSTALL_TIMEOUT + 120)
def test_wheel_with_demo_extra_in_a_clean_venv(installed: Path, tmp_path: Path) -> None:
    jupyter = installed / "jupyter"
    check_server_extension(jupyter)
    check_labextension(jupyter)
    # The [demo] extra brought JupyterLab and a kernel; the [hub] extra was not asked for.
    packages = run([installed / "python", "-m", "pip", "list", "--format=freeze"], 120).lower()
    assert "jupyterlab==" in packages and "ipykernel==" in packages
    assert "jupyterhub==" not in packages
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
