"""The installation a user gets: both halves of the extension registered and enabled.

These run the real ``jupyter`` commands of the environment the suite runs in (CI installs
the package with ``.ci/setup``), so a missing shared-data mapping, server config file or
labextension build fails here rather than in a user's JupyterLab.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_gpu_hotplug import __version__

# Starts real servers or toolchains: left out of the fast default run (conftest.py).
pytestmark = pytest.mark.slow

JUPYTER = Path(sys.executable).with_name("jupyter")


def run_jupyter(*args: str, jupyter: Path = JUPYTER) -> str:
    done = subprocess.run(
        [str(jupyter), *args], capture_output=True, text=True, timeout=120, check=True
    )
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # drop colour codes


def check_server_extension(jupyter: Path = JUPYTER) -> None:
    listing = run_jupyter("server", "extension", "list", jupyter=jupyter)
    assert re.search(r"jupyter_gpu_hotplug enabled", listing), listing
    assert re.search(rf"jupyter_gpu_hotplug {re.escape(__version__)} OK", listing), listing


def check_labextension(jupyter: Path = JUPYTER) -> None:
    listing = run_jupyter("labextension", "list", jupyter=jupyter)
    assert re.search(rf"jupyter-gpu-hotplug v{re.escape(__version__)} enabled\s+OK", listing), (
        listing
    )


@pytest.mark.skipif(not JUPYTER.exists(), reason=f"no jupyter command next to {sys.executable}")
def test_server_extension_is_enabled_and_ok() -> None:
    check_server_extension()


@pytest.mark.skipif(not JUPYTER.exists(), reason=f"no jupyter command next to {sys.executable}")
def test_labextension_is_enabled_and_ok() -> None:
    check_labextension()
