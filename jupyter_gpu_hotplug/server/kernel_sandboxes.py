"""Which process is a kernel's sandbox: local mode's answer to "attach to *this* notebook".

Boundary: from a kernel id to the pid the agent targets (``{"pid": N}``), through the
server's kernel manager. Nothing here talks to the agent or knows about GPUs.

Why a seam of its own: in local mode every kernel runs in its own sandbox, started by the
sandbox kernel provisioner, and that provisioner says which process the sandbox is
(``sandbox_pid``). The server extension must not import the provisioner (it sits on host
mechanics the notebook side never touches), so it asks the running kernel's provisioner by
duck typing. ``KernelSandboxes`` is a ``Type`` trait (``c.GPUHotplug.kernel_sandboxes_class``)
so that another kernel manager — or a test that maps kernel ids to prepared sandboxes
without starting kernels — can answer instead.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from .errors import HotplugError, KernelNotFound, KernelNotRunning, KernelNotSandboxed
from .validation import KernelId

__all__ = ["KernelSandboxes", "ProvisionerSandboxes"]


class KernelSandboxes(abc.ABC):
    """Maps a kernel id to the pid of the kernel's sandbox (the agent's target).

    Constructed once per server with the server's kernel manager.
    """

    def __init__(self, *, kernel_manager: Any) -> None:
        self.kernel_manager = kernel_manager

    @abc.abstractmethod
    def pid_of(self, kernel_id: KernelId) -> int:
        """The sandbox's pid. Raises ``KernelNotFound`` (no such kernel),
        ``KernelNotSandboxed`` (it runs without a sandbox) or ``KernelNotRunning``
        (it has no process now: starting, restarting, stopping)."""

    def process_of(self, kernel_id: KernelId) -> int:
        """The pid of the kernel's outermost process, below which all its processes run (for
        per-kernel attribution). Default: the sandbox's pid. Raises as :meth:`pid_of`."""
        return self.pid_of(kernel_id)

    def kernel_processes(self) -> dict[int, KernelId]:
        """Every running kernel by :meth:`process_of`, sandboxed or not."""
        return self._by_pid(self.process_of)

    def kernel_ids(self) -> list[KernelId]:
        """The kernels to look at in :meth:`kernels_by_pid` (default: the kernel manager's)."""
        return [KernelId(kernel_id) for kernel_id in self.kernel_manager.list_kernel_ids()]

    def kernels_by_pid(self) -> dict[int, KernelId]:
        """The reverse map: which kernel each running sandbox is (a GPU holder's kernel)."""
        return self._by_pid(self.pid_of)

    def _by_pid(self, pid_of: Callable[[KernelId], int]) -> dict[int, KernelId]:
        found: dict[int, KernelId] = {}
        for kernel_id in self.kernel_ids():
            try:
                found[pid_of(kernel_id)] = kernel_id
            except HotplugError:  # not sandboxed, or between two lives: no process
                continue
        return found


_NO_SANDBOX = object()


class ProvisionerSandboxes(KernelSandboxes):
    """Asks the kernel's provisioner: a sandboxing one exposes ``sandbox_pid``."""

    def pid_of(self, kernel_id: KernelId) -> int:
        provisioner = self._provisioner(kernel_id)
        pid = getattr(provisioner, "sandbox_pid", _NO_SANDBOX)
        if pid is _NO_SANDBOX:
            raise KernelNotSandboxed(kernel_id)
        return _pid(kernel_id, "sandbox_pid", pid)

    def process_of(self, kernel_id: KernelId) -> int:
        """The sandbox's pid for a sandboxed kernel; else the kernel's own process, which
        jupyter_client's local provisioner names ``pid`` (Kubernetes mode's kernels)."""
        provisioner = self._provisioner(kernel_id)
        if hasattr(provisioner, "sandbox_pid"):
            return _pid(kernel_id, "sandbox_pid", provisioner.sandbox_pid)
        return _pid(kernel_id, "pid", getattr(provisioner, "pid", None))

    def _provisioner(self, kernel_id: KernelId) -> Any:
        try:
            kernel = self.kernel_manager.get_kernel(kernel_id)
        except KeyError as error:
            raise KernelNotFound(kernel_id) from error
        provisioner = getattr(kernel, "provisioner", None)
        if provisioner is None:
            # jupyter_client drops the provisioner while a kernel is down (between a shutdown
            # and the next start).
            raise KernelNotRunning(kernel_id)
        return provisioner


def _pid(kernel_id: KernelId, attribute: str, pid: object) -> int:
    """A provisioner's pid, checked: ``None`` is a kernel without a process now."""
    if pid is None:
        raise KernelNotRunning(kernel_id)
    if not isinstance(pid, int) or isinstance(pid, bool):
        raise TypeError(f"the provisioner of kernel {kernel_id} gave {attribute}={pid!r}")
    return pid
