"""What the attack tests share: a real agent, a request from a process of the test's choosing
over the agent's unix socket (no token), and cgroups made and removed by the test."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from jupyter_gpu_hotplug.linux import cgroups
from tests.agent.agent_process import REPLY_TIMEOUT, AgentProcess, client_argv, wait_for_answer
from tests.agent.api_harness import ApiClient


def tcp(agent: AgentProcess) -> ApiClient:
    """The agent's TCP client, with its token (the administrator's view)."""
    assert agent.tcp is not None
    return agent.tcp


@contextmanager
def own_cgroups(name: str) -> Iterator[list[Path]]:
    """A fresh cgroup ``name`` below the root of every device hierarchy this host has
    (neither a root cgroup nor the agent's), removed afterwards once empty."""
    found = cgroups.discover()
    made: list[Path] = []
    try:
        for mount in (found.devices_v1, found.unified):
            if mount is None:
                continue
            directory = mount.mount_point / f"{name}-{os.getpid()}"
            directory.mkdir()
            made.append(directory)
        yield made
    finally:
        for directory in made:
            _rmdir_when_empty(directory)


def _rmdir_when_empty(directory: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def start_in(directories: Sequence[Path], argv: Sequence[str]) -> subprocess.Popen[bytes]:
    """``argv`` started inside ``directories`` (cgroups) from its first instruction: a root
    shell joins them, then execs it."""
    joins = "; ".join(f"echo $$ > {d / 'cgroup.procs'}" for d in directories)
    return subprocess.Popen(["sh", "-c", f'{joins}; exec "$@"', "sh", *argv])


def nest(top: Path, depth: int) -> list[Path]:
    """``depth`` cgroups nested one in another below ``top`` (as a container may make in its
    own cgroup); returned deepest last. Made relative to a directory fd, so that the depth
    is not limited by the length of a path."""
    made: list[Path] = []
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    path = top
    try:
        for _ in range(depth):
            os.mkdir("n", dir_fd=fd)
            path = path / "n"
            made.append(path)
            child = os.open("n", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    return made


def unnest(made: Sequence[Path]) -> None:
    """Remove what ``nest`` made, deepest first (one-letter names keep the paths short)."""
    for path in reversed(made):
        _rmdir_when_empty(path)


__all__ = [
    "REPLY_TIMEOUT",
    "client_argv",
    "nest",
    "own_cgroups",
    "start_in",
    "tcp",
    "unnest",
    "wait_for_answer",
]
