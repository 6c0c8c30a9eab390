"""Test helpers for the host mechanics: a controllable child process and scratch v1 cgroups.

A :class:`Probe` is the test suite's probe program (:mod:`tests.fixtures.sandbox_probe`) run
as a plain child of the test, outside any sandbox: the test moves it between cgroups itself
and asks it to open paths, so it can watch a *running* process gain and lose access (ENXIO =
the cgroup allowed a ``c 195:N`` node that has no driver here, EPERM = the cgroup denied it).
It names itself ``PROBE_COMM`` so tests can check the command name other code reports.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.linux import cgroups
from tests.fixtures.probe_client import PROBE_SCRIPT, ProbeClient

PROBE_COMM = "h4probe"


class Probe(ProbeClient):
    """A running child process that opens and holds device nodes when asked."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(PROBE_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            super().__init__(self.process.pid, stdin=self.process.stdin, stdout=self.process.stdout)
            if (named := self.set_name(PROBE_COMM)) != "OK":
                raise RuntimeError(f"the probe could not rename itself: {named}")
        except BaseException:
            self.close()
            raise

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


def make_nodes(directory: Path, minors: Iterable[int]) -> dict[int, Path]:
    """Char device nodes ``nvidia<minor>`` (``c 195:<minor>``) in ``directory`` for a probe."""
    nodes = {}
    for minor in minors:
        path = directory / f"nvidia{minor}"
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, minor))
        nodes[minor] = path
    return nodes
