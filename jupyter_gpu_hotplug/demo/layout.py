"""The demo's directories: where every file of one demo run lives, and the starter notebook.

Why one place: the runner, JupyterLab's configuration, the tests and the user (who is told
where notebooks and logs are) must agree on every path. The demo's own state must be
removable as one directory, and the user's notebooks must never be in it: they live in a
directory of their own, which the demo never removes. The layout is a pure value;
``prepare`` and ``install_starter`` are its only writes.

::

    <notebooks>/             JupyterLab's root dir (default: the current directory), with the
                             starter notebook; the user's work, kept when the demo stops
    <root>/                  the demo's state (a temporary directory unless --state-dir)
      agent/                 the agent's state dir, 0700: ledger, token, lock
      agent.sock             the agent's API (unix socket; callers known by their credentials)
      agent.log, jupyterlab.log
      simulation/            the simulated GPUs' config, written and animated by the agent
      simulation-tools/      the SIMULATED nvidia-smi, first on simulated kernels' PATH
      nvml/                  the fake libnvidia-ml.so.1 the kernels load
      jupyterlab/            0700: JupyterLab's config (holds the token), runtime dir,
                             settings overrides and the demo's kernel spec
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final

from ..agent.local.simulate import CONFIG_NAME
from ..agent.settings import TOKEN_FILE

__all__ = ["STARTER_NOTEBOOK", "DemoLayout", "starter_notebook_text"]

STARTER_NOTEBOOK: Final = "gpu-hotplug-starter.ipynb"
"""The starter notebook's name in the notebooks directory (and the URL the demo opens)."""
_STARTER_RESOURCE: Final = "starter.ipynb"


def starter_notebook_text() -> str:
    """The starter notebook shipped in this package, as JSON text."""
    return resources.files(__package__).joinpath(_STARTER_RESOURCE).read_text(encoding="utf-8")


@dataclass(frozen=True)
class DemoLayout:
    """The paths of one demo run: its state below ``root``, the user's ``notebooks`` apart
    (see the module docstring)."""

    root: Path
    notebooks: Path

    @property
    def agent_state(self) -> Path:
        return self.root / "agent"

    @property
    def agent_socket(self) -> Path:
        return self.root / "agent.sock"

    @property
    def agent_url(self) -> str:
        return f"unix:{self.agent_socket}"

    @property
    def agent_token(self) -> Path:
        """The agent's bearer token for TCP callers (the agent creates it, mode 0600)."""
        return self.agent_state / TOKEN_FILE

    @property
    def agent_log(self) -> Path:
        return self.root / "agent.log"

    @property
    def simulation_dir(self) -> Path:
        return self.root / "simulation"

    @property
    def simulation_config(self) -> Path:
        """The simulated GPUs' config, which the agent writes and the kernels' NVML reads."""
        return self.simulation_dir / CONFIG_NAME

    @property
    def simulation_tools(self) -> Path:
        """Commands simulated kernels find first on their ``PATH`` (the SIMULATED
        ``nvidia-smi``)."""
        return self.root / "simulation-tools"

    @property
    def nvml_cache(self) -> Path:
        """Where the kernels' fake ``libnvidia-ml.so.1`` is built."""
        return self.root / "nvml"

    @property
    def starter(self) -> Path:
        return self.notebooks / STARTER_NOTEBOOK

    @property
    def lab_dir(self) -> Path:
        return self.root / "jupyterlab"

    @property
    def lab_config(self) -> Path:
        """JupyterLab's configuration for this run (mode 0600: it holds the token)."""
        return self.lab_dir / "demo_config.json"

    @property
    def lab_runtime(self) -> Path:
        """``JUPYTER_RUNTIME_DIR`` of the demo's JupyterLab: connection files stay in here."""
        return self.lab_dir / "runtime"

    @property
    def lab_settings(self) -> Path:
        """JupyterLab's application settings dir for this run (``overrides.json``)."""
        return self.lab_dir / "settings"

    @property
    def lab_workspaces(self) -> Path:
        """JupyterLab's workspaces of this run: the pages' layouts stay with the run instead
        of piling up in the user's ``~/.jupyter/lab/workspaces``, where the user's next
        JupyterLab would reopen the demo's notebooks."""
        return self.lab_dir / "workspaces"

    @property
    def lab_data(self) -> Path:
        """Put first on the server's ``JUPYTER_PATH``: holds the demo's kernel spec."""
        return self.lab_dir / "data"

    @property
    def kernelspec(self) -> Path:
        """The demo's ``python3`` kernel spec, which shadows ipykernel's own."""
        return self.lab_data / "kernels" / "python3" / "kernel.json"

    @property
    def lab_log(self) -> Path:
        return self.root / "jupyterlab.log"

    def prepare(self) -> None:
        """Create the directories that the demo itself writes to (the agent makes its own)."""
        self.root.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.notebooks.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.lab_dir.mkdir(mode=0o700, exist_ok=True)
        # An existing dir keeps its mode; ours must be private whatever the umask was.
        self.lab_dir.chmod(0o700)

    def install_starter(self) -> Path:
        """Copy the starter notebook in, unless a (maybe edited) one is already there."""
        if not self.starter.exists():
            self.starter.write_text(starter_notebook_text(), encoding="utf-8")
        return self.starter

    def remove(self) -> None:
        """Delete the run's state directory (only a temporary one the demo made); the
        notebooks directory is the user's and stays."""
        shutil.rmtree(self.root)
