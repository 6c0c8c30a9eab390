"""Who uses a GPU: NVML's processes grouped by the process trees they belong to.

Boundary: reads ``/proc/<pid>/stat`` (each process's parent) and nothing else; takes the
processes a ``GpuState`` lists and which pids are *roots* (a kernel's process, a notebook
server's) of which owner, and returns each owner's share of the GPU. It knows nothing of Jupyter:
the server extension passes its kernels, the ``%gpu`` magic its own kernel.

Why the parent chain: what uses a GPU is rarely the kernel process itself — a training script
started with ``!python train.py``, a data-loader worker, the simulation's load helper are its
descendants. A process belongs to the nearest root found walking up from it, so a kernel
started by a notebook server belongs to the kernel, not to the server.

Why "unattributed" and not a guess: NVML names processes by pid *in the pid namespace it
resolves them in*. Inside a container, some drivers report the host's pids, which mean
nothing (or, worse, another process) in the container's ``/proc``. A pid that is not visible
here is therefore never matched to anything: its memory is counted as unattributed. A pid that
is visible but outside every root (another user's process, on a node whose ``/proc`` shows
them) is counted only as a sum, so no other tenant's pid or command is ever shown.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Generic, TypeVar

from .state import GpuProcess

__all__ = ["GpuUse", "ProcessTree", "Root", "Usage", "attribute"]

K = TypeVar("K", bound=Hashable)

Root = Callable[[int], K | None]
"""Whose root a pid is (``None``: not a root): a map's ``get``, or a test of the process."""

MAX_DEPTH: Final = 64
"""Ancestors looked at above a GPU process: deeper trees than this are not a notebook's."""


@dataclass(frozen=True)
class Usage:
    """What a group of processes uses of one GPU."""

    memory_bytes: int | None = None
    """The sum of the memory NVML reports for them; ``None`` when it reports none (common in
    containers) — not 0, which would claim they use none."""
    sm_util_percent: int | None = None
    """The sum of their SM utilisation samples (percent of the GPU's time); ``None`` when NVML
    has no sample for any of them."""
    processes: int = 0

    def plus(self, process: GpuProcess) -> Usage:
        return Usage(
            memory_bytes=_add(self.memory_bytes, process.used_memory),
            sm_util_percent=_add(self.sm_util_percent, process.sm_util),
            processes=self.processes + 1,
        )


def _add(total: int | None, value: int | None) -> int | None:
    if value is None:
        return total
    return value if total is None else total + value


@dataclass(frozen=True)
class GpuUse(Generic[K]):
    """One GPU's processes, grouped."""

    by_owner: Mapping[K, Usage] = field(default_factory=dict)
    """Each owner (root) that has a process on the GPU, with what they use."""
    others: Usage = Usage()
    """Visible here, below none of the roots: shown only as a sum."""
    unattributed: Usage = Usage()
    """Pids that are not visible here (another pid namespace, or already gone)."""


class ProcessTree:
    """Parents of processes, read from ``proc`` (``/proc``) once per pid and instance: make one
    per reading, so a pid reused later is read again."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._parents: dict[int, int | None] = {}

    def parent(self, pid: int) -> int | None:
        """``pid``'s parent; ``None`` when ``pid`` is not visible here (or has no parent:
        pid 1, or a process whose parent is outside this pid namespace, reads 0)."""
        if pid not in self._parents:
            self._parents[pid] = self._read_parent(pid)
        return self._parents[pid]

    def visible(self, pid: int) -> bool:
        return pid > 0 and self.parent(pid) is not None

    def _read_parent(self, pid: int) -> int | None:
        try:
            stat = (self._proc / str(pid) / "stat").read_bytes()
        except OSError:  # not in this pid namespace, or gone
            return None
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")" ends it.
        fields = stat[stat.rfind(b")") + 2 :].split()
        try:
            return int(fields[1])
        except (IndexError, ValueError):
            return None

    def owner(self, pid: int, root: Root[K]) -> K | None:
        """The owner of the first root met walking up from ``pid`` (itself included)."""
        current: int | None = pid
        for _ in range(MAX_DEPTH):
            if current is None or current <= 0:
                return None
            found = root(current)
            if found is not None:
                return found
            current = self.parent(current)
        return None


def attribute(
    processes: Iterable[GpuProcess], root: Root[K], tree: ProcessTree | None
) -> GpuUse[K]:
    """Group ``processes`` (one GPU's, as NVML lists them) by the root each belongs to.
    ``tree``: ``None`` when NVML's pids are known to be another pid namespace's (a process in
    a sandbox of its own reading the host's pids): then every process is unattributed."""
    by_owner: dict[K, Usage] = {}
    others = unattributed = Usage()
    for process in processes:
        if tree is None or not tree.visible(process.pid):
            unattributed = unattributed.plus(process)
            continue
        owner = tree.owner(process.pid, root)
        if owner is None:
            others = others.plus(process)
        else:
            by_owner[owner] = by_owner.get(owner, Usage()).plus(process)
    return GpuUse(by_owner=by_owner, others=others, unattributed=unattributed)
