"""One supervised child process of the demo: started detached from the terminal, stopped in turn.

Why it exists: the demo must decide the *order* of shutdown — JupyterLab first (its kernels'
sandboxes go with it), then the agent (after it has released every GPU). If the children shared
the terminal's process group, one Ctrl-C would reach all of them at once, JupyterLab would ask
"Shutdown this Jupyter server (y/[n])?" and the agent could stop while kernels still hold GPUs.
So each child gets a session of its own and stdin from ``/dev/null``; only the demo hears the
terminal, and it signals its children itself.

If the demo itself is killed (``kill -9``), the kernel sends each child ``SIGTERM``
(``PR_SET_PDEATHSIG``), so neither JupyterLab nor the agent outlives it unattended.

Output goes to a log file per child; ``log_tail`` gives the last lines for error messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

__all__ = ["ChildProcess", "log_tail"]

_PR_SET_PDEATHSIG: Final = 1
_KILL_WAIT: Final = 10.0
_TAIL_BYTES: Final = 64 * 1024


def _die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` asking the kernel to SIGTERM the child when the demo dies.

    The libc function is looked up here, in the parent: between ``fork`` and ``exec`` only the
    bare call runs.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = (ctypes.c_int, ctypes.c_ulong)
    prctl.restype = ctypes.c_int

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return preexec


def log_tail(path: Path, *, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        with path.open("rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - _TAIL_BYTES))
            data = file.read()
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


class ChildProcess:
    """A started child; create with :meth:`start`."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, log_path: Path) -> None:
        self.name = name
        self._process = process
        self.log_path = log_path

    @classmethod
    async def start(
        cls,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> ChildProcess:
        """Start ``argv`` in a session of its own, output appended to ``log_path``.

        ``OSError`` when the program cannot be executed.
        """
        with log_path.open("ab") as log:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        return cls(name, process, log_path)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    async def wait(self) -> int:
        return await self._process.wait()

    def send_signal(self, signum: int) -> None:
        """Signal the child (not its group); a no-op once it has exited."""
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # Exited, not yet reaped.
                self._process.send_signal(signum)

    async def stop(self, *, timeout: float) -> int:
        """SIGTERM, then SIGKILL to its whole process group after ``timeout``; the exit code."""
        self.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(asyncio.shield(self.wait()), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):  # The group has just emptied.
                os.killpg(self.pid, signal.SIGKILL)
            return await asyncio.wait_for(self.wait(), _KILL_WAIT)

    def describe_exit(self) -> str:
        """How the child ended, e.g. "exited with code 1" or "was killed by SIGKILL"."""
        code = self._process.returncode
        if code is None:
            return "is still running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def log_tail(self, *, lines: int = 15) -> str:
        return log_tail(self.log_path, lines=lines)
