"""The package's layering (docs/architecture.md) is enforced, not just described.

The contracts live in ``pyproject.toml`` under ``[tool.importlinter]``: the Linux mechanics
import nothing of ours above them, the notebook side never imports the agent and vice
versa, and the client and server extension never touch host mechanics.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
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


def test_every_module_of_the_agent_core_is_in_its_layers() -> None:
    """A module the layers contract does not list may import any other of the core, so a
    circle can hide there (issue 38: ``idle`` and ``bundle`` imported each other, and four
    modules were outside the contract)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [
        c["layers"]
        for c in contracts["contracts"]
        if c["type"] == "layers" and c.get("containers") == ["jupyter_gpu_hotplug.agent.core"]
    ]
    listed = {name.strip() for layer in layers for name in layer.split("|")}
    core = ROOT / "jupyter_gpu_hotplug" / "agent" / "core"
    modules = {path.stem for path in core.glob("*.py") if path.stem != "__init__"}
    assert modules - listed == set(), "core modules outside the layers contract"
    assert listed - modules == set(), "the layers contract lists modules that do not exist"
