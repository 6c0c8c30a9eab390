"""What the sandbox boundary costs at start: a sandbox with and without its hardening.

Run as root on a host with cgroups:

    .venv/bin/python benchmarks/bench_sandbox_start.py [--runs 40]

Times ``Sandbox.start`` + ``wait`` + ``stop`` of ``/bin/true`` with the defaults (Docker's
capability set, the read-only view, the hidden state directory) and with all three turned off
(``capabilities=None, read_only=False, hidden=()``), alternating so that machine noise hits
both alike. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _agent import percentile, remove_parent_cgroups

from jupyter_gpu_hotplug.linux.sandbox.runtime import Sandbox, SandboxSpec

PARENT = "gpu-hotplug-sandboxes/bench-sandbox-start"


def once(spec: SandboxSpec) -> float:
    start = time.perf_counter()
    sandbox = Sandbox.start(spec)
    sandbox.wait(timeout=60)
    sandbox.stop()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    hardened = SandboxSpec(("/bin/true",), cgroup_parent=PARENT, name_prefix="bench", cwd="/tmp")
    plain = SandboxSpec(
        ("/bin/true",),
        cgroup_parent=PARENT,
        name_prefix="bench",
        cwd="/tmp",
        capabilities=None,
        read_only=False,
        hidden=(),
    )
    samples: dict[str, list[float]] = {"hardened": [], "plain": []}
    try:
        for _ in range(args.runs):
            samples["plain"].append(once(plain))
            samples["hardened"].append(once(hardened))
    finally:
        remove_parent_cgroups(PARENT)
    for name, values in samples.items():
        print(
            f"  {name:9} start+exit+stop  median {statistics.median(values) * 1000:6.1f} ms   "
            f"p99 {percentile(values, 0.99) * 1000:6.1f} ms   (n={len(values)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
