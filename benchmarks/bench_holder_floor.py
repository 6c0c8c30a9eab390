"""The smallest memory limit a holder pod's container starts and stays up under, and how
long it takes to start under small CPU limits: what ``--holder-memory``/``--holder-cpu``
rest on.

Run as root on a host with cgroups and Debian's containerd/runc/busybox-static:

    .venv/bin/python benchmarks/bench_holder_floor.py [--runs 10] [--runc PATH]

``--runc`` names another runc binary (``ctr run --runc-binary``), e.g. the real-node tier's
(``~/.cache/jupyter-gpu-hotplug/node/bin/runc-v1.5.2/runc``, built by
``tests/realnode/build.sh``); the default is Debian's.

Why a measurement: the memory limit of a holder's container is its cgroup's, and runc's own
``runc init`` runs inside that cgroup before it executes the pause process (runc 1.1 first
copies its ~10 MiB binary into a sealed memfd, charged to the container's cgroup). Below that
floor the container is OOM-killed as it starts and never runs, and the kubelet retries it for
ever. The pause process itself needs almost nothing afterwards.

How: a private containerd (the Kubernetes test tier's, ``tests/k8s/containerd.py``; runc as
its runtime, cgroupfs) runs the tier's pause image (busybox's static ``sleep infinity``,
standing in for ``registry.k8s.io/pause``: both are one small static binary that sleeps) with
``ctr run --memory-limit``:

1. with a generous limit, ``--runs`` times: the cgroup's peak usage
   (``memory.max_usage_in_bytes``, v1) once the task runs — runc init's high-water mark — and
   its steady usage;
2. from 1 MiB up in 1 MiB steps, ``--runs`` starts per limit: the lowest limit at which every
   start reaches RUNNING and stays there with no OOM kill (``memory.failcnt`` and the task's
   status), and the highest at which one failed;
3. at the chosen memory limit, the time from ``ctr run`` to RUNNING under CPU limits of 1m,
   10m and 100m (CFS quota per 100 ms period).

Figures are printed, never asserted; docs/performance.md records them.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The tier's containerd stands in for the node's; it lives with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.k8s.containerd import SNAPSHOTTER, Containerd, start_containerd
from tests.k8s.image import PAUSE_IMAGE

MIB = 1024 * 1024
MEMORY_V1 = Path("/sys/fs/cgroup/memory")
_RUNNING_WAIT = 60.0
_STEADY_CHECKS = 5


_RUNC: list[str] = []
"""``--runc-binary`` and its path when ``--runc`` is given (set once by ``main``)."""


def _run(daemon: Containerd, name: str, *, memory: int, cpu_quota: int | None = None) -> float:
    """Start ``name`` detached; the seconds from the call to the task's RUNNING state (or
    ``inf`` when it never ran: OOM-killed at start)."""
    args = [
        "run",
        "-d",
        "--snapshotter",
        SNAPSHOTTER,
        "--memory-limit",
        str(memory),
        "--cgroup",
        f"{daemon.cgroup_top}/{name}",
        *_RUNC,
    ]
    if cpu_quota is not None:
        args += ["--cpu-period", "100000", "--cpu-quota", str(cpu_quota)]
    started = time.monotonic()
    try:
        daemon.ctr(*args, PAUSE_IMAGE, name)
    except subprocess.CalledProcessError:
        return float("inf")
    deadline = started + _RUNNING_WAIT
    while time.monotonic() < deadline:
        status = _status(daemon, name)
        if status == "RUNNING":
            return time.monotonic() - started
        if status in ("STOPPED", None):
            return float("inf")
        time.sleep(0.01)
    return float("inf")


def _status(daemon: Containerd, name: str) -> str | None:
    for line in daemon.ctr("tasks", "ls").splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == name:
            return fields[-1]
    return None


def _cgroup(daemon: Containerd, name: str) -> Path:
    return MEMORY_V1 / daemon.cgroup_top.lstrip("/") / name


def _stays_up(daemon: Containerd, name: str) -> bool:
    """Still RUNNING over a few reads of its state, and no OOM kill in its cgroup."""
    for _ in range(_STEADY_CHECKS):
        if _status(daemon, name) != "RUNNING":
            return False
        time.sleep(0.05)
    control = (_cgroup(daemon, name) / "memory.oom_control").read_text().split()
    kills = dict(zip(control[::2], control[1::2], strict=True)).get("oom_kill", "0")
    return kills == "0"


def _remove(daemon: Containerd, name: str) -> None:
    for args in (("tasks", "kill", "-s", "SIGKILL", name), ("tasks", "rm", "-f", name)):
        with contextlib.suppress(subprocess.CalledProcessError):
            daemon.ctr(*args)
    deadline = time.monotonic() + 10
    while _status(daemon, name) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    with contextlib.suppress(subprocess.CalledProcessError):
        daemon.ctr("containers", "rm", name)
    cgroup = _cgroup(daemon, name)
    if cgroup.exists():
        cgroup.rmdir()


def peak_usage(daemon: Containerd, runs: int) -> tuple[list[int], list[int]]:
    peaks, steady = [], []
    for i in range(runs):
        name = f"floor-peak-{i}"
        try:
            assert _run(daemon, name, memory=256 * MIB) < float("inf"), "no start at 256 MiB"
            cgroup = _cgroup(daemon, name)
            peaks.append(int((cgroup / "memory.max_usage_in_bytes").read_text()))
            steady.append(int((cgroup / "memory.usage_in_bytes").read_text()))
        finally:
            _remove(daemon, name)
    return peaks, steady


def lowest_limit(daemon: Containerd, runs: int) -> tuple[int, int | None]:
    """The lowest MiB at which all ``runs`` starts succeed, and the highest that failed."""
    failed_at: int | None = None
    for mib in range(1, 65):
        ok = 0
        for i in range(runs):
            name = f"floor-{mib}-{i}"
            try:
                if _run(daemon, name, memory=mib * MIB) < float("inf") and _stays_up(daemon, name):
                    ok += 1
            finally:
                _remove(daemon, name)
        print(f"  {mib:3d} MiB: {ok}/{runs} started and stayed up", flush=True)
        if ok < runs:
            failed_at = mib
        elif failed_at is not None or mib == 1:
            return mib, failed_at
    raise RuntimeError("no limit up to 64 MiB worked")


def start_times(daemon: Containerd, runs: int, memory: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for millicores in (1, 10, 100):
        quota = max(1000, millicores * 100)  # CFS: at least 1 ms per period
        key = f"{millicores}m"
        for i in range(runs):
            name = f"floor-cpu-{millicores}-{i}"
            try:
                times.setdefault(key, []).append(_run(daemon, name, memory=memory, cpu_quota=quota))
            finally:
                _remove(daemon, name)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--holder-memory-mib", type=int, default=24)
    parser.add_argument("--runc", help="another runc binary to run the containers with")
    args = parser.parse_args()
    if args.runc:
        _RUNC[:] = ["--runc-binary", args.runc]
    runc = subprocess.run([args.runc or "runc", "--version"], capture_output=True, text=True).stdout
    print(f"runtime: containerd (tier) + {runc.splitlines()[0]}")
    daemon = start_containerd()
    try:
        peaks, steady = peak_usage(daemon, args.runs)
        print(
            f"peak usage while starting (runc init, then pause), {args.runs} runs: "
            f"median {statistics.median(peaks) / MIB:.1f} MiB, max {max(peaks) / MIB:.1f} MiB; "
            f"steady {statistics.median(steady) / MIB:.2f} MiB"
        )
        print("lowest memory limit with every start up:")
        floor, failed = lowest_limit(daemon, args.runs)
        print(f"floor: {floor} MiB (highest failing: {failed} MiB)")
        times = start_times(daemon, args.runs, args.holder_memory_mib * MIB)
        for key, values in times.items():
            finite = [v for v in values if v != float("inf")]
            print(
                f"start to RUNNING at cpu {key}, memory {args.holder_memory_mib} MiB: "
                f"{len(finite)}/{len(values)} started, median "
                f"{statistics.median(finite) * 1000 if finite else float('nan'):.0f} ms, "
                f"max {max(finite) * 1000 if finite else float('nan'):.0f} ms"
            )
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
