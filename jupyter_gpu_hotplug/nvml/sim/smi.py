"""A look-alike of ``nvidia-smi`` for kernels on simulated GPUs, clearly marked SIMULATED.

``nvidia-smi`` is the first thing a data scientist types after attaching a GPU. On simulated
GPUs there is no driver and no ``nvidia-smi``; this prints the familiar table (and ``-L``'s
list) from the same fake NVML the kernel's ``pynvml`` reads, through ``nvml.state`` — so it
shows exactly the GPUs this container has, numbered as this container's NVML numbers them,
like the real one in a container. The demo puts it on simulated kernels' ``PATH`` as
``nvidia-smi`` (``write_command``); nothing else is imitated (no queries, no settings).

Boundary: NVML through ``nvml.state`` only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from ..state import GpuMonitor, GpuState, Snapshot
from .config import SIMULATED_SUFFIX

__all__ = [
    "BANNER",
    "COMMAND_NAME",
    "main",
    "portable_command",
    "render",
    "render_list",
    "write_command",
]

COMMAND_NAME: Final = "nvidia-smi"
BANNER: Final = (
    "SIMULATED nvidia-smi (jupyter-gpu-hotplug): the fake NVML of a simulated node; "
    "no NVIDIA driver or GPU is behind these numbers."
)
MODULE: Final = "jupyter_gpu_hotplug.nvml.sim.smi"
"""What ``python -m`` runs (``__name__`` is ``__main__`` when it does)."""
_MIB: Final = 1024 * 1024
_WIDTHS: Final = (41, 24, 22)
"""The three cells of a GPU's row, as in the real table."""


def _line(*cells: str) -> str:
    return (
        "|"
        + "|".join(cell.ljust(width)[:width] for cell, width in zip(cells, _WIDTHS, strict=True))
        + "|"
    )


def _rule(fill: str = "-") -> str:
    return "+" + "+".join(fill * width for width in _WIDTHS) + "+"


def _watts(value: float | None) -> str:
    return "N/A" if value is None else f"{value:.0f}W"


def _rows(gpu: GpuState) -> list[str]:
    used = "N/A" if gpu.memory_used is None else f"{gpu.memory_used // _MIB}MiB"
    total = "N/A" if gpu.memory_total is None else f"{gpu.memory_total // _MIB}MiB"
    temp = "N/A" if gpu.temperature is None else f"{gpu.temperature}C"
    util = "N/A" if gpu.utilization_gpu is None else f"{gpu.utilization_gpu}%"
    power = f"{_watts(gpu.power_draw)} / {_watts(gpu.power_limit)}"
    name = (gpu.name or "GPU").removesuffix(SIMULATED_SUFFIX)
    return [
        _line(f" {gpu.index:>3}  {name[:29]:<29}  Off", f" {'N/A':>22}", f"{'N/A':>21}"),
        _line(
            f" N/A  {temp:>5}  P0  {power:>21}", f" {used:>9} / {total:>10}", f" {util:>9}  Default"
        ),
    ]


def render(snapshot: Snapshot) -> str:
    """The default ``nvidia-smi`` table of ``snapshot``, with the SIMULATED banner first."""
    driver = snapshot.driver_version or "N/A"
    cuda = snapshot.cuda_driver_version or "N/A"
    width = sum(_WIDTHS) + 2
    head = f" NVIDIA-SMI (SIMULATED)   Driver Version: {driver}   CUDA Version: {cuda}"
    lines = [
        BANNER,
        "+" + "-" * width + "+",
        "|" + head.ljust(width) + "|",
        _rule(),
        _line(
            " GPU  Name                 Persistence-M",
            " Bus-Id          Disp.A",
            " Volatile Uncorr. ECC",
        ),
        _line(
            " Fan  Temp  Perf          Pwr:Usage/Cap",
            "           Memory-Usage",
            " GPU-Util  Compute M.",
        ),
        _rule("="),
    ]
    for gpu in snapshot.gpus:
        lines.extend(_rows(gpu))
        lines.append(_rule())
    if not snapshot.gpus:
        lines.append("|" + f" No GPU in this container: {snapshot.message}".ljust(width) + "|")
        lines.append("+" + "-" * width + "+")
    lines += ["", "Processes:"]
    processes = [
        (gpu.index, process.pid, process.name or "?", process.used_memory)
        for gpu in snapshot.gpus
        for process in gpu.processes or ()
    ]
    if not processes:
        lines.append("  No running processes found")
    for index, pid, name, memory in processes:
        used = "N/A" if memory is None else f"{memory // _MIB}MiB"
        lines.append(f"  GPU {index}  PID {pid:>7}  {name:<40} {used:>10}")
    return "\n".join(lines)


def render_list(snapshot: Snapshot) -> str:
    """``nvidia-smi -L``: one line per GPU, after the banner."""
    lines = [BANNER]
    lines.extend(f"GPU {gpu.index}: {gpu.name} (UUID: {gpu.uuid})" for gpu in snapshot.gpus)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args not in ([], ["-L"], ["--list-gpus"]):
        print(BANNER, file=sys.stderr)
        print(
            f"only '{COMMAND_NAME}' and '{COMMAND_NAME} -L' are simulated, not {' '.join(args)}",
            file=sys.stderr,
        )
        return 2
    with GpuMonitor() as monitor:
        snapshot = monitor.snapshot()
    print(render_list(snapshot) if args else render(snapshot))
    return 0


def write_command(directory: Path, *, python: str = sys.executable) -> Path:
    """Write ``directory/nvidia-smi``, which runs ``main`` with ``python``; returns its path.

    The directory goes first on a simulated kernel's ``PATH``. Written afresh on every call
    (a moved interpreter must not leave a stale script)."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    path = directory / COMMAND_NAME
    path.write_text(
        f"#!{python}\n"
        f"# {BANNER}\n"
        "import sys\n\n"
        "from jupyter_gpu_hotplug.nvml.sim.smi import main\n\n"
        "sys.exit(main())\n"
    )
    path.chmod(0o755)
    return path


def portable_command() -> str:
    """The text of an ``nvidia-smi`` that runs ``main`` with whatever ``python3`` is on the
    ``PATH`` where it runs: the simulated driver root's (``driver_root``), which a CDI spec
    mounts into containers.

    Why ``/bin/sh`` rather than ``write_command``'s interpreter line: inside a container the
    host's interpreter path means nothing, and every image has a ``/bin/sh``. It needs this
    package importable by that ``python3`` (a notebook image with the extension has it); where
    it is not, it says so and exits 127, as a shell does for a missing command."""
    return (
        "#!/bin/sh\n"
        f"# {BANNER}\n"
        "for python in python3 python; do\n"
        '  if command -v "$python" >/dev/null 2>&1 && "$python" -c '
        "'import jupyter_gpu_hotplug' 2>/dev/null; then\n"
        f'    exec "$python" -m {MODULE} "$@"\n'
        "  fi\n"
        "done\n"
        f"echo '{BANNER}' >&2\n"
        "echo 'it needs python3 with jupyter-gpu-hotplug installed, and this container has "
        "none' >&2\n"
        "exit 127\n"
    )


if __name__ == "__main__":
    sys.exit(main())
