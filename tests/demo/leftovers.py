"""What a demo run may leave on the host, looked at from outside: the evidence for "nothing left".

Each function reads one kind of host state with nothing but the kernel's own interfaces —
``/proc`` for processes and mounts, the cgroup filesystems for sandbox cgroups, ``bpf(2)`` for
device programs, SQLite (read-only) for the agent's ledger — so the checks do not trust the
code under test to report on itself. A process is known by its pid *and* start time
(``Proc``), so a pid the kernel reuses later is never mistaken for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from jupyter_gpu_hotplug.agent.local.ledger import LEDGER_FILE
from jupyter_gpu_hotplug.demo.labconfig import SANDBOX_NAME_PREFIX
from jupyter_gpu_hotplug.linux import cgroups, procfs
from jupyter_gpu_hotplug.linux.bpf import syscall
from jupyter_gpu_hotplug.linux.bpf.syscall import ProgId
from jupyter_gpu_hotplug.sandboxes.provisioner import DEFAULT_KERNEL_CGROUP_PARENT

from ..fixtures.host_state import process_running, stat_fields


@dataclass(frozen=True)
class Proc:
    """One process: its pid and its start time (clock ticks since boot)."""

    pid: int
    start_time: int

    @classmethod
    def of(cls, pid: int) -> Proc | None:
        who = procfs.identity(pid)
        return None if who is None else cls(pid, who.start_time)

    def running(self) -> bool:
        """Still this process, and not a zombie."""
        return process_running(self.pid, self.start_time)

    def kill(self) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):  # Gone since the check.
                os.kill(self.pid, signal.SIGKILL)

    def cmdline(self) -> list[str]:
        try:
            raw = Path(f"/proc/{self.pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return []
        return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _parents() -> dict[int, int]:
    """pid → parent pid, for every process now."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name))
        if fields is not None:
            parents[int(entry.name)] = int(fields[1])
    return parents


def process_tree(root: int) -> list[Proc]:
    """``root`` and all its descendants now."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if (proc := Proc.of(pid)) is not None:
            found.append(proc)
        todo += children.get(pid, [])
    return found


def sandbox_parents() -> list[Path]:
    """The kernel sandboxes' parent cgroup in each device hierarchy of this host."""
    found = cgroups.discover()
    mounts = [m for m in (found.devices_v1, found.unified) if m is not None]
    return [mount.mount_point / DEFAULT_KERNEL_CGROUP_PARENT for mount in mounts]


def demo_sandboxes(owners: Iterable[Proc] | None = None) -> list[Path]:
    """Cgroup directories of demo kernels (named ``<demo prefix>.<owner>-<start>.<token>``).

    ``owners`` narrows them to sandboxes made by those processes (a demo's JupyterLab), so
    that another demo running on the same machine at the same time is not counted.
    """
    wanted = None if owners is None else {f"{p.pid}-{p.start_time}" for p in owners}
    found: list[Path] = []
    for parent in sandbox_parents():
        with contextlib.suppress(FileNotFoundError):
            found += [
                entry
                for entry in parent.iterdir()
                if entry.is_dir()
                and entry.name.startswith(f"{SANDBOX_NAME_PREFIX}.")
                and (wanted is None or entry.name.split(".")[1] in wanted)
            ]
    return sorted(found)


def all_sandbox_cgroups() -> set[Path]:
    """Every cgroup below the sandboxes' parents, demo or not (to compare before and after)."""
    found: set[Path] = set()
    for parent in sandbox_parents():
        with contextlib.suppress(FileNotFoundError):
            found |= {entry for entry in parent.iterdir() if entry.is_dir()}
    return found


def device_programs(directories: list[Path]) -> set[ProgId]:
    """Ids of the cgroup device programs attached at those cgroup2 directories."""
    unified = cgroups.discover().unified
    ids: set[ProgId] = set()
    for directory in directories:
        if unified is None or not directory.is_relative_to(unified.mount_point):
            continue
        with syscall.Fd(os.open(directory, os.O_RDONLY | os.O_DIRECTORY)) as fd:
            ids |= set(syscall.prog_query(fd).prog_ids)
    return ids


def processes_mentioning(text: str) -> list[Proc]:
    """Running processes whose command line contains ``text`` (e.g. the demo's directory)."""
    procs = (Proc.of(pid) for pid in _parents())
    return [
        p for p in procs if p is not None and p.running() and any(text in a for a in p.cmdline())
    ]


def still_running(processes: list[Proc]) -> list[Proc]:
    return [p for p in processes if p.running()]


@dataclass(frozen=True)
class LedgerContents:
    gpus: list[tuple[str, int]]
    """``(uuid, minor)`` of every GPU the agent knew."""
    attachments: list[tuple[str, str, str]]
    """``(uuid, target, state)`` of every GPU still owned by someone."""


def read_ledger(agent_state: Path) -> LedgerContents:
    """The agent's ledger, opened read-only (the agent must have exited)."""
    uri = f"file:{agent_state / LEDGER_FILE}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
        gpus = db.execute("SELECT uuid, minor FROM gpus ORDER BY minor").fetchall()
        attachments = db.execute("SELECT uuid, target_key, state FROM attachments").fetchall()
    return LedgerContents(gpus=gpus, attachments=attachments)
