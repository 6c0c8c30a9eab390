"""Who holds a GPU, in the words a notebook user recognises: the notebook, or the pod.

Why it exists: the agent names a holder by its technical identity — ``process 11269`` in local
mode, ``pod ns/name`` in Kubernetes mode — and its API stays that way. A person at a notebook
recognises a notebook, so the notebook side adds that name next to the technical id.

How a kernel knows which notebook a process is: jupyter_server starts every kernel of a
notebook session with ``JPY_SESSION_NAME`` (the notebook's path) in its environment. This
kernel reads its own from ``os.environ``; another kernel's is read from
``/proc/<pid>/environ`` when this process may read it (the same user and pid namespace; a
sandboxed kernel sees its own sandbox's processes only, so there the server, which sees every
kernel, names the others), and otherwise the holder stays ``process N``. A sandboxed kernel
knows the pid the agent names it by from ``GPU_HOTPLUG_SANDBOX_PID``. Only that one variable is
taken, and it is shown as text (the widget escapes it): it names a file, it is not trusted for
anything.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from .._structs import SANDBOX_PID_ENV, PidRef, PodTarget, TargetRef

__all__ = ["SESSION_ENV", "HolderNames", "session_in_tree", "session_of"]

SESSION_ENV: Final = "JPY_SESSION_NAME"
"""Set by jupyter_server in the environment of a notebook session's kernel: the notebook's path."""


def session_of(pid: int, *, proc: Path = Path("/proc")) -> str | None:
    """The notebook path in the environment of process ``pid``, if it has one and this
    process may read it."""
    try:
        environ = (proc / str(pid) / "environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return None
    prefix = SESSION_ENV.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return os.fsdecode(entry[len(prefix) :]) or None
    return None


def session_in_tree(pid: int, *, proc: Path = Path("/proc"), limit: int = 64) -> str | None:
    """The notebook of ``pid`` or, failing that, of the first of its descendants that has one
    (breadth first, at most ``limit`` processes): the pid the agent names a sandboxed kernel by
    is its sandbox's first process, and the kernel runs below it in its own pid namespace. For
    the host's tools (``jupyter gpu-hotplug status`` as root), which see every process."""
    queue = [pid]
    for _ in range(limit):
        if not queue:
            break
        current = queue.pop(0)
        found = session_of(current, proc=proc)
        if found is not None:
            return found
        try:
            children = (proc / str(current) / "task" / str(current) / "children").read_text()
        except OSError:  # gone, or a kernel without CONFIG_PROC_CHILDREN
            continue
        queue.extend(int(child) for child in children.split())
    return None


def _own_target_pid(env: Mapping[str, str]) -> int:
    """The pid the agent names this kernel by: in a sandbox, the sandbox's (this process's
    own pid is its pid namespace's); elsewhere, this process's."""
    try:
        return int(env[SANDBOX_PID_ENV])
    except (KeyError, ValueError):
        return os.getpid()


class HolderNames:
    """Describes holders for this kernel (process ``own_pid``, environment ``environ``)."""

    def __init__(
        self,
        *,
        own_pid: int | None = None,
        environ: Mapping[str, str] | None = None,
        session_of: Callable[[int], str | None] = session_of,
    ) -> None:
        env = os.environ if environ is None else environ
        self.own_pid = own_pid if own_pid is not None else _own_target_pid(env)
        self.own_notebook = env.get(SESSION_ENV) or None
        self._session_of = session_of

    def _short(self, path: str) -> str:
        """``path`` relative to this notebook's folder when it is below it."""
        if self.own_notebook is None:
            return path
        folder = os.path.dirname(self.own_notebook)
        relative = os.path.relpath(path, folder) if os.path.isabs(path) and folder else path
        return path if relative.startswith("..") else relative

    def name(self, target: TargetRef | None) -> str:
        """The short form for tables: ``this notebook``, ``b.ipynb``, ``process 14``,
        ``pod ns/name``; ``""`` for no holder."""
        if target is None:
            return ""
        if isinstance(target, PodTarget):
            return f"pod {target.namespace}/{target.name}"
        assert isinstance(target, PidRef)
        return self.kernel_name(target.pid) or f"process {target.pid}"

    def kernel_name(self, pid: int) -> str | None:
        """``this notebook`` (or ``this kernel``) for this kernel's pid, the short name of
        the notebook whose session ``pid`` carries (a kernel, or a process it started: the
        environment is inherited), ``None`` for a process of no notebook."""
        if pid == self.own_pid:
            return "this notebook" if self.own_notebook else "this kernel"
        notebook = self._session_of(pid)
        if notebook is None:
            return None
        if notebook == self.own_notebook:
            return "this notebook"
        short = self._short(notebook)
        # A path outside this notebook's folder: its file name is what the user knows.
        return os.path.basename(short) if os.path.isabs(short) else short

    def describe(self, target: TargetRef | None) -> str:
        """``this notebook (a.ipynb, process 12)``, ``b.ipynb (process 13)``, ``process 14``,
        ``pod ns/name``; ``""`` for no holder."""
        if target is None:
            return ""
        if isinstance(target, PodTarget):
            return str(target)
        assert isinstance(target, PidRef)
        own = target.pid == self.own_pid
        notebook = self.own_notebook if own else self._session_of(target.pid)
        technical = f"process {target.pid}"
        if own:
            shown = "this notebook" if notebook else "this kernel"
            detail = f"{self._short(notebook)}, {technical}" if notebook else technical
            return f"{shown} ({detail})"
        return f"{self._short(notebook)} ({technical})" if notebook else technical
