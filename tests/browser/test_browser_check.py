"""JupyterLab's own smoke test (``python -m jupyterlab.browser_check``) in a real browser.

It loads the whole application, with every installed extension, in Chromium and fails if
any plugin fails to activate. :mod:`tests.browser.run_browser_check` points it at Debian's
Chromium (it would otherwise download a browser, which is never allowed here).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.fixtures.browser import needs_chromium

pytestmark = needs_chromium

ROOT = Path(__file__).parents[2]


def test_jupyterlab_browser_check_passes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.browser.run_browser_check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "failed to activate" not in output
