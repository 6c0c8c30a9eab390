"""What the user asked the demo for, as one frozen value, and the defaults.

Kept free of heavy imports: the command line builds it while parsing (``--help`` must be
instant), and the runner, preflight checks and tests take it as their single input.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

DEFAULT_IP: Final = "127.0.0.1"
"""Loopback only: the demo runs as root, so the network must be asked for (``--ip``)."""
DEFAULT_PORT: Final = 8888
DEFAULT_SIMULATED_GPUS: Final = 2
"""Simulated GPUs when no real one is found and ``--simulate`` was not given."""
MAX_SIMULATED_GPUS: Final = 64


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """The demo's command-line options, checked."""

    simulate: int | None = None
    """``None``: real GPUs if NVML finds any, else ``DEFAULT_SIMULATED_GPUS`` simulated ones;
    ``0``: real GPUs only (fail if there are none); ``N``: N simulated GPUs, real ones or not."""
    port: int = DEFAULT_PORT
    ip: str = DEFAULT_IP
    open_browser: bool = True
    state_dir: Path | None = None
    """Where the demo keeps its own files: agent state and socket, logs, JupyterLab's
    configuration (kept afterwards); ``None``: a fresh temporary directory, removed when the
    demo ends cleanly."""
    notebook_dir: Path | None = None
    """Where notebooks are saved, and kept when the demo stops: JupyterLab's root directory;
    ``None``: the current directory (as ``jupyter lab`` does)."""

    def __post_init__(self) -> None:
        if self.simulate is not None and not 0 <= self.simulate <= MAX_SIMULATED_GPUS:
            raise ValueError(
                f"--simulate must be from 0 to {MAX_SIMULATED_GPUS} GPUs, got {self.simulate}"
            )
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be from 1 to 65535, got {self.port}")
        if not self.ip:
            raise ValueError("--ip must not be empty (use 0.0.0.0 for every interface)")
