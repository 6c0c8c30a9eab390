"""Cost of one ``GpuMonitor.snapshot()`` with 1 and 8 simulated GPUs.

Run (no root, no GPU needed; builds the fake NVML into a temporary cache):

    .venv/bin/python benchmarks/bench_gpu_snapshot.py [--runs 1000]

The monitor reads the real ``pynvml`` over the simulator's ``libnvidia-ml.so.1``, so the figures
are Python + pynvml + ctypes + ``/proc`` reads, without the real driver's ioctls (a real GPU
adds its own cost per query). This process runs on every GPU (its name is read from ``/proc``
once per snapshot), and each GPU has one more process that is not visible here. Rows:

- ``steady``: the widget's 1 Hz case: the real ``/dev`` is listed, nothing changed.
- ``re-init``: a device node appeared or went since the last snapshot, so NVML is shut down,
  initialised and enumerated again (the hot-plug case).

Median and p99 in microseconds; figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from jupyter_gpu_hotplug.nvml.sim import (
    CONFIG_ENV,
    FakeNvmlConfig,
    SimulatedProcess,
    default_gpus,
    ensure_fake_nvml,
    load_in_process,
    write_config,
)
from jupyter_gpu_hotplug.nvml.state import GpuMonitor, NvmlStatus

_NOT_HERE = 2**22  # above every pid_max: never a process of this machine


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(
    action: Callable[[], object], runs: int, *, before: Callable[[], object]
) -> list[float]:
    samples = []
    for _ in range(runs):
        before()
        start = time.perf_counter()
        action()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def report(label: str, samples: list[float]) -> None:
    print(
        f"  {label:<30} median {statistics.median(samples):8.1f} µs"
        f"   p99 {percentile(samples, 0.99):8.1f} µs   (n={len(samples)})"
    )


def node(count: int) -> FakeNvmlConfig:
    """``count`` busy GPUs: this process uses all of them, plus one invisible process each."""
    gpus = tuple(
        dataclasses.replace(
            gpu,
            utilization_gpu=40,
            processes=(
                SimulatedProcess(os.getpid(), 2**30),
                SimulatedProcess(_NOT_HERE + index, None),
            ),
        )
        for index, gpu in enumerate(default_gpus(count))
    )
    return FakeNvmlConfig(gpus=gpus)


def nothing() -> None:
    """No preparation between samples."""


def toggle(node_path: Path) -> None:
    """Make or remove a device node name, so the next snapshot must re-initialise NVML."""
    if node_path.exists():
        node_path.unlink()
    else:
        node_path.touch()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="snapshots per row (>= 500)")
    args = parser.parse_args()
    runs = max(args.runs, 500)

    with tempfile.TemporaryDirectory(prefix="bench-snapshot-") as scratch:
        root = Path(scratch)
        library = ensure_fake_nvml(root / "cache")
        config_path = root / "fake-nvml.conf"
        dev = root / "dev"
        dev.mkdir()
        write_config(config_path, node(1))
        os.environ[CONFIG_ENV] = str(config_path)
        load_in_process(library)

        print(f"GpuMonitor.snapshot(), fake NVML, {runs} snapshots per row")
        for count in (1, 8):
            write_config(config_path, node(count))
            # Steady: the real /dev is listed, as in a container (it holds no nvidia nodes here).
            with GpuMonitor(dev_dir=Path("/dev")) as monitor:
                first = monitor.snapshot()
                assert first.status is NvmlStatus.OK and len(first.gpus) == count, first.message
                for _ in range(20):  # warm caches and pynvml's function-pointer table
                    monitor.snapshot()
                report(f"{count} GPU(s), steady", measure(monitor.snapshot, runs, before=nothing))
            with GpuMonitor(dev_dir=dev) as monitor:
                monitor.snapshot()
                before = monitor.init_count
                samples = measure(
                    monitor.snapshot, runs, before=functools.partial(toggle, dev / "nvidia99")
                )
                assert monitor.init_count - before == runs, "every sample re-initialised"
                report(f"{count} GPU(s), re-init", samples)


if __name__ == "__main__":
    main()
