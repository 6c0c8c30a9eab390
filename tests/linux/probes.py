"""Test helpers for the host mechanics: a controllable child process and scratch v1 cgroups.

A :class:`Probe` is a small Python child driven over a pipe: it opens paths on
request and answers ``OK`` or the errno name, so a test can watch a *running*
process gain and lose access (ENXIO = the cgroup allowed a ``c 195:N`` node that
has no driver here, EPERM = the cgroup denied it). It names itself ``h4probe``
so tests can check the command name other code reports.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from jupyter_gpu_hotplug.linux import cgroups

PROBE_COMM = "h4probe"

_CHILD = r"""
import ctypes, errno, os, signal, sys
ctypes.CDLL(None).prctl(15, b"@COMM@", 0, 0, 0)  # PR_SET_NAME
held = []
print("READY", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    try:
        if command == "open":
            os.close(os.open(args[0], os.O_RDWR))
            reply = "OK"
        elif command == "hold":
            held.append(os.open(args[0], os.O_RDONLY))
            reply = "OK " + str(held[-1])
        elif command == "ignore-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            reply = "OK"
        else:
            reply = "ERR unknown command"
    except OSError as e:
        reply = "ERR " + errno.errorcode[e.errno]
    print(reply, flush=True)
""".replace("@COMM@", PROBE_COMM)


class Probe:
    """A running child process that opens device nodes when asked."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-u", "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self._readline()
        if ready != "READY":
            self.close()
            raise RuntimeError(f"probe failed to start: {ready!r}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def _readline(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def ask(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._readline()

    def open(self, path: Path) -> str:
        """``OK`` if the node opened read-write, else the errno name (``EPERM``, ``ENXIO``)."""
        reply = self.ask(f"open {path}")
        return reply.removeprefix("ERR ")

    def hold(self, path: Path) -> int:
        """Open ``path`` read-only and keep it open; returns the child's fd number."""
        reply = self.ask(f"hold {path}")
        if not reply.startswith("OK "):
            raise RuntimeError(f"probe could not hold {path}: {reply}")
        return int(reply.split()[1])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


@contextlib.contextmanager
def probe() -> Iterator[Probe]:
    child = Probe()
    try:
        yield child
    finally:
        child.close()


@contextlib.contextmanager
def scratch_v1_cgroup() -> Iterator[Path]:
    """A fresh cgroup directly below the v1 ``devices`` root; removed afterwards with
    everything below it (processes still inside are moved back to the root first)."""
    mount = cgroups.discover().devices_v1
    if mount is None:
        raise RuntimeError("this host has no v1 devices hierarchy")
    root = mount.mount_point
    top = root / f"h4test-{uuid.uuid4().hex[:12]}"
    top.mkdir()
    try:
        yield top
    finally:
        for directory in reversed([top, *cgroups.descendants(top)]):
            for pid in cgroups.pids_in_cgroup(directory, recursive=False):
                with contextlib.suppress(ProcessLookupError):
                    (root / "cgroup.procs").write_text(str(pid))
            directory.rmdir()


def move_into(cgroup_dir: Path, pid: int) -> None:
    (cgroup_dir / "cgroup.procs").write_text(str(pid))


def make_nodes(directory: Path, minors: range, major: int = 195) -> dict[int, Path]:
    """Char device nodes ``nvidia<minor>`` in ``directory`` for a probe to open."""
    nodes = {}
    for minor in minors:
        path = directory / f"nvidia{minor}"
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        nodes[minor] = path
    return nodes
