"""Helpers for tests that need a real cgroup2 hierarchy (the process to put in it is
``tests.linux.probes.Probe``).

Plain functions, not fixtures: each test module wraps them in its own fixtures so that
cleanup order stays visible where it matters.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path


def _unescape_mountinfo(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match[1], 8)), field)


def cgroup2_mount() -> Path | None:
    """Where the cgroup2 hierarchy is mounted (``/sys/fs/cgroup`` or ``…/unified``)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_fields, _, fs_fields = line.partition(" - ")
        if fs_fields.split()[0] == "cgroup2":
            return Path(_unescape_mountinfo(mount_fields.split()[4]))
    return None


def own_cgroup2(mount: Path) -> Path:
    """This process's cgroup2 directory (from the ``0::`` line of /proc/self/cgroup)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return mount / line[3:].lstrip("/")
    raise AssertionError("no cgroup2 line in /proc/self/cgroup")


@contextlib.contextmanager
def temporary_cgroup(mount: Path) -> Iterator[Path]:
    """A fresh cgroup2 directory, removed with everything below it afterwards.

    Processes still inside are moved back to our own cgroup first; device
    programs attached anywhere in the tree are released by the kernel with the
    directories.
    """
    path = mount / f"gpu-hotplug-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        home = own_cgroup2(mount)
        for directory, _, _ in os.walk(path, topdown=False):
            for pid in Path(directory, "cgroup.procs").read_text().split():
                # A process that exited meanwhile has left the cgroup anyway.
                with contextlib.suppress(ProcessLookupError):
                    (home / "cgroup.procs").write_text(pid)
            os.rmdir(directory)
