"""Static checks run with the suite, so CI enforces them: ruff (lint and format) and
``mypy --strict`` over the package, the tests and the benchmarks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Starts real servers or toolchains: left out of the fast default run (conftest.py).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
TREES = ("jupyter_gpu_hotplug", "tests", "benchmarks")


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["ruff", "check", *TREES], id="ruff-check"),
        pytest.param(["ruff", "format", "--check", *TREES], id="ruff-format"),
        pytest.param(["mypy", "--strict", *TREES], id="mypy-strict"),
    ],
)
def test_static_check_passes(argv: list[str]) -> None:
    tool = BIN / argv[0]
    assert tool.exists(), f"{argv[0]} is part of the test extras"
    done = subprocess.run(
        [str(tool), *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
