"""Are there real NVIDIA GPUs here? Asked of NVML in a short-lived child process.

Why a child process: loading the driver's ``libnvidia-ml.so.1`` into the demo would pin that
library in this process for good, and a broken driver can hang or crash its caller; a child
that answers one JSON line within a timeout cannot harm the demo. The agent asks NVML again
itself, so this answer only decides whether the demo simulates GPUs.

The answer is plain data (``GpuProbe``) and the decision (``choose_gpu_mode``) is pure, so
both are tested without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Final

from ..nvml.sim import CONFIG_ENV, DEVICE_FILTER_ENV, INIT_ERROR_ENV
from .errors import DemoUnavailable
from .options import DEFAULT_SIMULATED_GPUS

__all__ = ["GpuMode", "GpuProbe", "choose_gpu_mode", "probe_real_gpus"]

_PROBE_TIMEOUT: Final = 30.0

# Runs in the child: count GPUs, and never let an exception escape as a traceback.
_PROBE_SCRIPT: Final = """
import json
try:
    import pynvml
    pynvml.nvmlInit()
    try:
        names = [
            pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            for i in range(pynvml.nvmlDeviceGetCount())
        ]
    finally:
        pynvml.nvmlShutdown()
except Exception as e:
    print(json.dumps({"names": [], "problem": f"{type(e).__name__}: {e}"}))
else:
    print(json.dumps({"names": [n if isinstance(n, str) else n.decode() for n in names]}))
"""


@dataclass(frozen=True)
class GpuProbe:
    """What NVML said: the GPUs' names, or why it could not be asked."""

    names: tuple[str, ...] = ()
    problem: str | None = None
    """Why NVML gave no answer (no driver, no library...), for the start-up message."""


@dataclass(frozen=True)
class GpuMode:
    """Which GPUs the demo's agent serves."""

    simulate: int
    """Number of simulated GPUs; 0 means the real ones."""
    reason: str
    """One sentence for the start-up message: why these GPUs."""

    @property
    def simulated(self) -> bool:
        return self.simulate > 0


def probe_real_gpus(*, timeout: float = _PROBE_TIMEOUT) -> GpuProbe:
    """Ask the real NVML (in a child) for its GPUs; never raises."""
    # A fake NVML configured in our environment (the demo run inside a simulated kernel)
    # must not pass for a real driver.
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in (CONFIG_ENV, DEVICE_FILTER_ENV, INIT_ERROR_ENV)
    }
    try:
        result = subprocess.run(
            [sys.executable, "-c", _PROBE_SCRIPT],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return GpuProbe(problem=f"NVML did not answer within {timeout:.0f} s")
    except OSError as e:
        return GpuProbe(problem=f"cannot run {sys.executable}: {e.strerror}")
    return parse_probe_output(result.stdout, returncode=result.returncode, stderr=result.stderr)


def parse_probe_output(stdout: str, *, returncode: int, stderr: str = "") -> GpuProbe:
    """The probe child's answer; anything unexpected is a ``problem``, not an exception."""
    last_line = stdout.strip().rsplit("\n", 1)[-1] if stdout.strip() else ""
    try:
        answer = json.loads(last_line)
        names = tuple(str(name) for name in answer["names"])
        problem = answer.get("problem")
    except (ValueError, KeyError, TypeError):
        detail = stderr.strip().rsplit("\n", 1)[-1] if stderr.strip() else "no answer"
        return GpuProbe(problem=f"the NVML probe failed (exit {returncode}): {detail}")
    return GpuProbe(names=names, problem=None if problem is None else str(problem))


def choose_gpu_mode(requested: int | None, probe: GpuProbe | None) -> GpuMode:
    """Real GPUs or simulated ones, from ``--simulate`` and what NVML found.

    ``probe`` may be ``None`` only when ``requested`` is positive (no need to ask NVML).
    """
    if requested is not None and requested > 0:
        return GpuMode(requested, f"--simulate {requested} was given")
    if probe is None:
        raise ValueError("choose_gpu_mode needs a probe unless --simulate N > 0 was given")
    if probe.names:
        return GpuMode(0, f"NVML found {len(probe.names)} NVIDIA GPU(s): {', '.join(probe.names)}")
    why = probe.problem or "NVML lists no GPU"
    if requested == 0:
        raise DemoUnavailable(
            f"--simulate 0 asks for real GPUs, but there are none ({why}).",
            hint=f"Leave --simulate out (or give --simulate {DEFAULT_SIMULATED_GPUS}) to run "
            "with simulated GPUs.",
        )
    return GpuMode(DEFAULT_SIMULATED_GPUS, f"no NVIDIA GPU was found ({why})")
