"""Grant and revoke latency of the hot-plug engine on real sandboxes, next to the floor.

Run as root on a host with cgroups (v1 devices and/or cgroup2):

    .venv/bin/python benchmarks/bench_engine.py [--runs 200]

For each backend set (v1, v2, hybrid) and for 1 and 8 devices it times
``HotplugEngine.grant`` and ``revoke`` on one running sandboxed process and prints
median and p99 in milliseconds. The floor is the same kernel work done with the bare
mechanisms and no engine logic: one ``devices.allow`` write per device (v1), one
program load + atomic replace (v2) and one ``mknodat`` per device — the cost no
implementation of this design can avoid. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.linux import cgroup_v2, devnodes
from jupyter_gpu_hotplug.linux.bpf import asm, syscall
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import CharDevice
from jupyter_gpu_hotplug.linux.engine import HotplugEngine
from jupyter_gpu_hotplug.linux.sandbox.runtime import Backend, Sandbox, SandboxSpec, host_backends

SETS = {
    "v1": frozenset({Backend.V1}),
    "v2": frozenset({Backend.V2}),
    "hybrid": frozenset({Backend.V1, Backend.V2}),
}


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(action: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    action(*args)
    return (time.perf_counter() - start) * 1000


def report(label: str, samples: list[float]) -> None:
    print(
        f"  {label:<34} median {statistics.median(samples):7.3f} ms"
        f"   p99 {percentile(samples, 0.99):7.3f} ms   (n={len(samples)})"
    )


def floor_grant(sandbox: Sandbox, nodes: list[DeviceNode]) -> None:
    """The unavoidable kernel work of a grant, with no checks, no verification."""
    cg = sandbox.cgroups
    if cg.v1 is not None:
        for node in nodes:
            (cg.v1 / "devices.allow").write_text(f"c {node.device.major}:{node.device.minor} rw")
    if cg.v2 is not None:
        (prog_id,) = cgroup_v2_ids(cg.v2)
        with syscall.prog_get_fd_by_id(prog_id) as old:
            original = asm.strip_prefix(syscall.prog_info(old).xlated)
            code = asm.add_prefix({node.device.rule() for node in nodes}, original)
            target_fd = syscall.Fd(os.open(cg.v2, os.O_RDONLY | os.O_DIRECTORY))
            with syscall.prog_load(code, name="floor") as new, target_fd as target:
                flags = syscall.AttachFlags.ALLOW_MULTI | syscall.AttachFlags.REPLACE
                syscall.prog_attach(target, new, flags=flags, replace=old)
    for node in nodes:
        devnodes.ensure_node(sandbox.pid, node.name, node.device)


def cgroup_v2_ids(directory: Path) -> list[syscall.ProgId]:
    return [syscall.ProgId(p.id) for p in cgroup_v2.attached_programs(directory)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (cgroups, eBPF, mount namespaces)", file=sys.stderr)
        return 2
    engine = HotplugEngine(control_nodes=())
    print(f"engine grant/revoke, {args.runs} runs each, {os.cpu_count()} CPUs")
    for label, backends in SETS.items():
        if not backends <= host_backends():
            print(f"{label}: not available on this host")
            continue
        spec = SandboxSpec(("sleep", "infinity"), backends=backends, name_prefix="bench")
        with Sandbox.start(spec) as sandbox:
            print(f"{label}:")
            for count in (1, 8):
                nodes = [
                    DeviceNode(f"nvidia{m}", CharDevice(NVIDIA_MAJOR, m)) for m in range(count)
                ]
                grants, revokes, floors = [], [], []
                for _ in range(args.runs):
                    grants.append(timed(engine.grant, sandbox.pid, nodes))
                    revokes.append(timed(engine.revoke, sandbox.pid, nodes))
                    floors.append(timed(floor_grant, sandbox, nodes))
                    engine.revoke(sandbox.pid, nodes)
                report(f"grant {count} device(s)", grants)
                report(f"revoke {count} device(s)", revokes)
                report(f"floor: bare syscalls, {count} device(s)", floors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
