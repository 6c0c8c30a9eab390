"""Who a process is, from ``/proc/<pid>/stat``: its command name and start time.

A pid alone can be reused by an unrelated process; the pair (pid, start time in
clock ticks since boot) cannot. Every module that remembers a process across
calls (the busy check, the engine, sandboxes, the agent's ledger) identifies it
this way, so the parsing lives in one place.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Final

PROC: Final = Path("/proc")
_START_TIME_INDEX: Final = 19
"""Field 22 of ``stat``, counted from the first field after the ``(comm)`` one."""


@dataclass(frozen=True)
class ProcessIdentity:
    """A running process's name and start time (clock ticks since boot)."""

    comm: str
    start_time: int


def is_gone(error: OSError) -> bool:
    """Whether ``error`` only means the process (or one of its fds) has gone away."""
    return error.errno in (errno.ENOENT, errno.ESRCH)


def parse_stat(text: str) -> ProcessIdentity:
    """Parse one ``/proc/<pid>/stat`` line.

    The command name may hold spaces and parentheses, so it is the text between
    the first ``(`` and the *last* ``)``.
    """
    comm = text[text.find("(") + 1 : text.rfind(")")]
    return ProcessIdentity(comm, int(text[text.rfind(")") + 2 :].split()[_START_TIME_INDEX]))


def identity(pid: int, *, proc: Path = PROC) -> ProcessIdentity | None:
    """The identity of ``pid`` in the pid namespace of ``proc``, or None when it has exited."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError as e:
        if is_gone(e):
            return None
        raise
    return parse_stat(text)
