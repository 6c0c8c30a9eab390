"""The package's layering (docs/architecture.md) is enforced, not just described.

The contracts live in ``pyproject.toml`` under ``[tool.importlinter]``: the Linux mechanics
import nothing of ours above them, the notebook side never imports the agent and vice
versa, and the client and server extension never touch host mechanics.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_import_contracts_are_kept() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports is not None, "import-linter is part of the test extras"
    done = subprocess.run(
        [lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
