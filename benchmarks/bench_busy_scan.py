"""How long the busy scan of a detach takes for a container with many processes and open files.

Run as root (the scan reads other processes' fds):

    .venv/bin/python benchmarks/bench_busy_scan.py [--processes 50] [--fds 2000] \
        [--kind files|sockets] [--runs 3]

Starts ``--processes`` child processes that each hold ``--fds`` open descriptors — ``files``:
``/dev/null`` (the scan stats each one), ``sockets``: unix socket pairs with nothing queued
(since issue 25 the scan also looks at each unix socket for queued messages, which costs a
``pidfd_getfd``, a ``poll`` and two ``ioctl`` per socket) — then times
``busy.holders_by_device`` over them for ``/dev/zero`` (which none holds), ``--runs`` times.
The interpreter's ``PYTHONPATH`` picks the checkout, so the same script times an older
commit's scan. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from jupyter_gpu_hotplug.linux import busy
from jupyter_gpu_hotplug.linux.devrules import CharDevice

HOLDER = """
import os, socket, sys
kind, count = sys.argv[1], int(sys.argv[2])
kept = []
if kind == "files":
    kept = [os.open("/dev/null", os.O_RDONLY) for _ in range(count)]
else:
    kept = [socket.socketpair() for _ in range(count // 2)]
print("ready", flush=True)
sys.stdin.read()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=50)
    parser.add_argument("--fds", type=int, default=2000)
    parser.add_argument("--kind", choices=["files", "sockets"], default="files")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    children = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, args.kind, str(args.fds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(args.processes)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        pids = [child.pid for child in children]
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            found = busy.holders_by_device(pids, [CharDevice(1, 5)])
            times.append(time.perf_counter() - start)
            assert found == {CharDevice(1, 5): []}
    finally:
        for child in children:
            child.kill()
            child.wait()
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()
    total = args.processes * args.fds
    median = statistics.median(times)
    with open("/proc/loadavg") as loadavg:
        load = loadavg.read().split()[0]
    print(
        f"busy scan: {args.processes} processes x {args.fds} {args.kind} = {total} fds "
        f"(load {load}): median {median:.2f} s of {args.runs}, {median / total * 1e6:.1f} us/fd"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
