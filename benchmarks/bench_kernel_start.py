"""Kernel start, restart and shutdown time in a sandbox, next to a plain local kernel.

Run as root on a host with cgroups (v1 devices and/or cgroup2):

    .venv/bin/python benchmarks/bench_kernel_start.py [--runs 10]

For ipykernel started by ``jupyter_client``'s ``AsyncKernelManager`` with the default
``LocalProvisioner`` and with ``SandboxedKernelProvisioner`` it times: *launch* (until the
provisioner returns: the process runs, inside its sandbox for the sandboxed one), *ready*
(until the kernel answers ``kernel_info``: what a user waits for), *restart* and
*shutdown*. Runs alternate between the two so that machine noise hits both alike. Figures
are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from jupyter_gpu_hotplug.linux import cgroups
from jupyter_gpu_hotplug.linux.sandbox.runtime import DEFAULT_CGROUP_PARENT, cleanup_stale
from jupyter_gpu_hotplug.sandboxes.provisioner import (
    sandboxed_kernelspec,
    write_sandboxed_kernelspec,
)

KERNELS = {"plain": "bench-plain", "sandboxed": "bench-sandboxed"}
CGROUP_PARENT = f"{DEFAULT_CGROUP_PARENT}/bench-{os.getpid()}"
NAME_PREFIX = "bench"
READY_TIMEOUT = 120.0
STEPS = ("launch", "ready", "restart", "shutdown")


def install_kernelspecs(kernels_dir: Path) -> None:
    """The same ipykernel twice: once sandboxed, once without a provisioner stanza."""
    config = {"name_prefix": NAME_PREFIX, "cgroup_parent": CGROUP_PARENT}
    sandboxed = sandboxed_kernelspec(config=config)
    write_sandboxed_kernelspec(kernels_dir, KERNELS["sandboxed"], spec=sandboxed)
    plain = {key: value for key, value in sandboxed.items() if key != "metadata"}
    write_sandboxed_kernelspec(kernels_dir, KERNELS["plain"], spec=plain)


def remove_cgroup_parent() -> None:
    """Remove this run's (now empty) parent cgroups after the sandboxes are gone."""
    cleanup_stale(NAME_PREFIX, cgroup_parent=CGROUP_PARENT, include_live_owners=True)
    found = cgroups.discover()
    for mount in (found.devices_v1, found.unified):
        if mount is not None:
            with contextlib.suppress(FileNotFoundError):
                (mount.mount_point / CGROUP_PARENT).rmdir()


async def timed(action: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await action()
    return (time.perf_counter() - start) * 1000


async def one_run(kernel_name: str, kernel_specs: KernelSpecManager) -> dict[str, float]:
    manager = AsyncKernelManager(kernel_name=kernel_name, kernel_spec_manager=kernel_specs)
    figures = {"launch": await timed(manager.start_kernel)}
    client = manager.client()
    client.start_channels()
    try:
        figures["ready"] = figures["launch"] + await timed(
            lambda: client.wait_for_ready(timeout=READY_TIMEOUT)
        )
        figures["restart"] = await timed(manager.restart_kernel)
        await client.wait_for_ready(timeout=READY_TIMEOUT)
    finally:
        client.stop_channels()
        figures["shutdown"] = await timed(manager.shutdown_kernel)
    return figures


def report(label: str, runs: list[dict[str, float]]) -> None:
    cells = []
    for step in STEPS:
        samples = [run[step] for run in runs]
        cells.append(f"{step} {statistics.median(samples):7.1f}")
    print(f"  {label:<10} median ms: " + "   ".join(cells) + f"   (n={len(runs)})")


async def main_async(runs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-kernel-") as tmp:
        os.environ["JUPYTER_RUNTIME_DIR"] = str(Path(tmp) / "runtime")
        kernels_dir = Path(tmp) / "kernels"
        install_kernelspecs(kernels_dir)
        kernel_specs = KernelSpecManager(kernel_dirs=[str(kernels_dir)])
        results: dict[str, list[dict[str, float]]] = {label: [] for label in KERNELS}
        try:
            for _ in range(runs + 1):  # The first round warms caches and is dropped.
                for label, name in KERNELS.items():
                    results[label].append(await one_run(name, kernel_specs))
        finally:
            remove_cgroup_parent()
        print(f"ipykernel with jupyter_client's AsyncKernelManager, {runs} runs each")
        for label in KERNELS:
            report(label, results[label][1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (sandboxes need cgroups and a mount namespace)", file=sys.stderr)
        return 2
    asyncio.run(main_async(args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
