"""``python -m jupyter_gpu_hotplug.nvml.sim.load``: make this container's simulated GPUs work.

A simulated GPU idles (0 %, no memory in use, idle power) until a process of the container it
is attached to uses it, the way a CUDA program does: by holding ``/dev/nvidia<minor>`` open.
With no NVIDIA driver an ordinary ``open`` of that node fails (ENXIO), so this helper holds
each node with ``O_PATH`` — which reaches no driver — for a while; the agent's simulation finds
it with the same scan of open device nodes that makes a detach refuse a busy GPU, and the
GPU's readings climb. A plain detach is then refused naming this process; ``--force`` ends
it. It does nothing useful on real GPUs (run real work there) and says so.

Boundary: ``os`` only; it knows the device nodes, not the agent.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

__all__ = ["gpu_nodes", "main"]

_NODE: Final = re.compile(r"nvidia([0-9]+)")
DEFAULT_SECONDS: Final = 60.0


def gpu_nodes(dev: Path = Path("/dev")) -> list[Path]:
    """This container's GPU nodes (``/dev/nvidia<minor>`` character devices), by minor."""
    found = []
    for entry in dev.iterdir():
        match = _NODE.fullmatch(entry.name)
        try:
            is_char = stat.S_ISCHR(entry.stat().st_mode)
        except OSError:
            continue
        if match is not None and is_char:
            found.append((int(match[1]), entry))
    return [path for _, path in sorted(found)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jupyter_gpu_hotplug.nvml.sim.load",
        description="SIMULATED GPUs only: hold this container's GPU device nodes open for a "
        "while, so the agent's simulation shows them working.",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=DEFAULT_SECONDS,
        help=f"how long to hold them (default {DEFAULT_SECONDS:g}); Ctrl-C ends sooner",
    )
    parser.add_argument("--dev", type=Path, default=Path("/dev"), help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.seconds > 0:
        print("error: --seconds must be more than 0", file=sys.stderr)
        return 2
    nodes = gpu_nodes(args.dev)
    if not nodes:
        print("SIMULATED load: this container has no GPU to use; attach one first.")
        return 1
    # Before the announcement: whoever read it may end this helper at once, and a SIGTERM
    # that came before the handler would kill it with no clean exit. The announcement is
    # inside the ``try`` for the same reason: the reader may end the helper while ``print``
    # is still returning, after the line went out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    fds = [os.open(node, os.O_PATH) for node in nodes]
    try:
        print(
            f"SIMULATED load: using {', '.join(map(str, nodes))} for {args.seconds:g} s "
            f"(process {os.getpid()}).",
            flush=True,
        )
        time.sleep(args.seconds)
    except KeyboardInterrupt:
        pass
    finally:
        for fd in fds:
            os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
