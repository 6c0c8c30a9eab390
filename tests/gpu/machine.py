"""The machine the real-GPU tier runs on: real NVIDIA GPUs, or the simulated rehearsal.

Why one object for both: the rehearsal (``run-on-device.sh --simulate``) must run *the same
steps* as the GPU machine, so every difference — which NVML the agent and the sandboxes load,
which ``nvidia-smi`` answers, whether PyTorch can run — is decided here, once, and the steps ask.

Real: ``/dev/nvidiactl`` exists and ``nvidia-smi`` answers; the agent runs without ``--simulate``
(the driver's ``libnvidia-ml.so.1``), sandboxes see the host's control nodes and the real
``nvidia-smi``. Simulated (``JGH_GPU_SIMULATE=N``): the agent runs ``--simulate=N`` with its
simulation in a directory of ours, sandboxes load the same fake NVML filtered by their ``/dev``,
and a SIMULATED ``nvidia-smi`` comes first on their ``PATH``.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from jupyter_gpu_hotplug.nvml.sim import ensure_fake_nvml, fake_nvml_environ
from jupyter_gpu_hotplug.nvml.sim.smi import write_command

__all__ = ["SIMULATE_ENV", "GpuMachine", "detect", "not_here_reason", "run_text"]

SIMULATE_ENV: Final = "JGH_GPU_SIMULATE"
"""Number of simulated GPUs of the rehearsal; unset on a GPU machine."""
CONTROL_NODE: Final = Path("/dev/nvidiactl")
_SIMULATION_CONFIG: Final = "fake-nvml.conf"


def run_text(argv: list[str], *, env: Mapping[str, str] | None = None, timeout: float = 60) -> str:
    """A command's exit status and output, as one text for the report (never raises)."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"[could not run: {e}]"
    return f"[exit {done.returncode}]\n{done.stdout}{done.stderr}"


def gvisor() -> str | None:
    """Why this kernel looks like gVisor's emulation, or ``None``.

    gVisor reports kernel 4.4.0 and says so in its ``dmesg``; cgroups, eBPF and device nodes
    there are emulated and may not behave (``../shared/FIELD.md``)."""
    release = platform.release()
    said = run_text(["dmesg"], timeout=10)
    if "gVisor" in said:
        return f"dmesg names gVisor (kernel {release})"
    if release == "4.4.0":
        return "kernel 4.4.0, the version gVisor reports"
    return None


def not_here_reason() -> str | None:
    """Why the tier cannot run here (no driver and no rehearsal asked for), or ``None``."""
    if os.environ.get(SIMULATE_ENV):
        return None
    if not CONTROL_NODE.exists():
        return (
            "no NVIDIA driver here (/dev/nvidiactl absent): run `bash tests/gpu/run-on-device.sh`"
            " on a GPU machine, or `--simulate` for the rehearsal"
        )
    if shutil.which("nvidia-smi") is None:
        return "/dev/nvidiactl exists but nvidia-smi is not on PATH"
    return None


@dataclass(frozen=True)
class GpuMachine:
    """What differs between the GPU machine and the rehearsal (see the module docstring)."""

    simulate: int
    """0 on real GPUs."""
    work_dir: Path
    """Shared with the sandboxes (under ``/tmp``, which they may write)."""
    library_dir: Path | None = None
    tools_dir: Path | None = None

    @property
    def simulated(self) -> bool:
        return self.simulate > 0

    @property
    def simulation_dir(self) -> Path:
        return self.work_dir / "simulation"

    def agent_args(self) -> list[str]:
        """The agent's arguments that choose its NVML. The sandboxes see the machine's own
        driver, so the agent gives them none (``--driver-files=off``): a GPU machine's minutes
        prove the GPU, the driver's files are proven on the real node."""
        if not self.simulated:
            return ["--driver-files=off"]
        return [f"--simulate={self.simulate}", f"--simulation-dir={self.simulation_dir}"]

    def environ(self, *, host_view: bool = False) -> dict[str, str]:
        """The environment of a process of the tier: in a sandbox (NVML filtered by its
        ``/dev``) or, with ``host_view``, the host's own view of every GPU."""
        env = dict(os.environ)
        if not self.simulated:
            return env
        assert self.library_dir is not None and self.tools_dir is not None
        env["PATH"] = f"{self.tools_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
        return fake_nvml_environ(
            self.library_dir,
            self.simulation_dir / _SIMULATION_CONFIG,
            device_filter=None if host_view else Path("/dev"),
            base=env,
        )

    def nvidia_smi(self) -> str:
        """The ``nvidia-smi`` the tier runs: the driver's, or the SIMULATED look-alike."""
        if self.tools_dir is not None:
            return str(self.tools_dir / "nvidia-smi")
        return shutil.which("nvidia-smi") or "nvidia-smi"


def detect(work_dir: Path) -> GpuMachine:
    """The machine of this run (call only where ``not_here_reason()`` is ``None``)."""
    simulate = int(os.environ.get(SIMULATE_ENV) or 0)
    if simulate <= 0:
        return GpuMachine(simulate=0, work_dir=work_dir)
    library_dir = ensure_fake_nvml()
    tools_dir = work_dir / "tools"
    write_command(tools_dir)
    return GpuMachine(
        simulate=simulate, work_dir=work_dir, library_dir=library_dir, tools_dir=tools_dir
    )
