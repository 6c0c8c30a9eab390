"""The ``demo`` subcommand of ``jupyter gpu-hotplug``: its arguments and its entry point.

Only argparse and the light ``options`` module are imported here; the runner (asyncio, the
client, the provisioner) is imported when the command runs, so ``--help`` stays instant.
Any ``DemoError`` becomes its message on stderr and exit code 1 — a user never sees a
traceback for a condition the demo understands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Final

from .options import DEFAULT_IP, DEFAULT_PORT, DEFAULT_SIMULATED_GPUS, DemoOptions

__all__ = ["HELP", "add_arguments", "options_from_args", "run"]

HELP: Final = "run a local JupyterLab with sandboxed kernels and GPU hot-plug"

_DESCRIPTION: Final = f"""\
Start a local-mode GPU agent and a JupyterLab whose kernels each run in their own sandbox
(private /dev, device cgroup without GPUs), then hot-plug GPUs into running kernels with
'%gpu attach 1' in a notebook (the magic is loaded in every kernel). Uses the machine's NVIDIA
GPUs when NVML finds any, otherwise {DEFAULT_SIMULATED_GPUS} simulated ones (clearly labelled).
Notebooks are saved in the current directory (or --notebook-dir) and kept. Needs Linux and
root. Ctrl-C stops JupyterLab, its kernels and the agent, and releases every GPU."""

EXIT_FAILED: Final = 1
EXIT_INTERRUPTED: Final = 130


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from e
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _port(text: str) -> int:
    value = _count(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, on its sub-parser."""
    parser.description = _DESCRIPTION
    parser.add_argument(
        "--simulate",
        type=_count,
        metavar="N",
        help=(
            "serve N simulated GPUs (even if real ones exist); 0: real GPUs only. Default: the "
            f"real GPUs if NVML finds any, otherwise {DEFAULT_SIMULATED_GPUS} simulated ones"
        ),
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"JupyterLab's port (default {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--ip",
        default=DEFAULT_IP,
        help=f"address JupyterLab listens on (default {DEFAULT_IP}; 0.0.0.0 for every interface)",
    )
    parser.add_argument(
        "--no-browser",
        dest="open_browser",
        action="store_false",
        help="do not open a browser (the URL is printed either way)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help=(
            "keep the demo's own files (agent state and socket, logs, JupyterLab's settings) "
            "in DIR and leave them there; default: a fresh temporary directory, removed at "
            "the end (notebooks are not in it)"
        ),
    )
    parser.add_argument(
        "--notebook-dir",
        type=Path,
        metavar="DIR",
        help=(
            "save notebooks in DIR (created if missing; kept when the demo stops); "
            "default: the current directory"
        ),
    )


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """The parsed arguments as ``DemoOptions`` (``ValueError`` names a bad one)."""
    return DemoOptions(
        simulate=args.simulate,
        port=args.port,
        ip=args.ip,
        open_browser=args.open_browser,
        state_dir=args.state_dir,
        notebook_dir=args.notebook_dir,
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo until it is stopped; the exit code."""
    from .errors import DemoError
    from .runner import run as run_demo

    try:
        options = options_from_args(args)
        return run_demo(options)
    except (DemoError, ValueError) as e:
        print(f"jupyter gpu-hotplug demo: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # Ctrl-C during the checks, before any child was started.
        print("jupyter gpu-hotplug demo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
