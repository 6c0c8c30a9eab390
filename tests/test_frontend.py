"""The JupyterLab extension's own checks, run with the suite so CI enforces them: prettier and
eslint over ``labextension/``, and its jest unit tests (model, stream client, menu rules).

They use the node modules that ``.ci/setup`` installed when it built the labextension
(``jlpm`` is JupyterLab's bundled yarn, beside this interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Starts real servers or toolchains: left out of the fast default run (conftest.py).
pytestmark = pytest.mark.slow

LABEXTENSION = Path(__file__).parents[1] / "labextension"
JLPM = Path(sys.executable).parent / "jlpm"


@pytest.mark.parametrize(
    "script",
    [
        pytest.param("prettier:check", id="prettier"),
        pytest.param("eslint:check", id="eslint"),
        pytest.param("test", id="jest"),
    ],
)
def test_frontend_check_passes(script: str) -> None:
    assert JLPM.exists(), "jlpm comes with jupyterlab, part of the package's dependencies"
    assert (LABEXTENSION / "node_modules").is_dir(), (
        "labextension/node_modules is missing: run `bash .ci/setup` (it builds the extension)"
    )
    done = subprocess.run(
        [str(JLPM), "run", script],
        cwd=LABEXTENSION,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CI": "true", "PATH": f"{JLPM.parent}:{os.environ.get('PATH', '')}"},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
