"""Whom the server extension's operations act on: one strategy per mode, chosen once.

Boundary: from the kernel id a request names (or none) to the agent's target, the streams that
see the operation's progress and the words the log uses, plus what else a mode decides about
targets (must a kernel be named, are queue places read, which kernels may hold GPUs). Nothing
here talks to the agent, reads NVML or knows about HTTP.

Why strategies: the two modes answer "whose GPUs?" differently everywhere the manager looks —
in local mode every kernel runs in a sandbox of its own, so an operation names its kernel and
acts on that sandbox's pid; in Kubernetes mode the GPUs go to the notebook's pod, which the
agent knows from the caller's token, so no kernel is needed and every kernel of the pod shares
them. Written as ``mode`` tests, that difference was spread over the manager in half a dozen
places that had to agree with each other. Here each mode's answers sit together in one class,
``targets_for`` picks the class once when the manager is built, and the manager asks its
strategy without ever testing the mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Final, Protocol

from .._structs import PidRef
from .errors import KernelIdRequired
from .kernel_sandboxes import KernelSandboxes
from .models import Mode
from .validation import KernelId

__all__ = [
    "PodTargets",
    "SandboxTargets",
    "Target",
    "Targets",
    "kernel_required",
    "targets_for",
]


@dataclass(frozen=True)
class Target:
    """Whom one operation acts on."""

    ref: PidRef | None
    """The agent's target: a kernel's sandbox, or ``None``: the caller itself (this pod, known
    to the agent from the token)."""
    scope: str | None
    """Whose streams see the operation's progress: one kernel's, or (``None``) every stream."""
    label: str
    """Who it is, for the log."""


class Targets(Protocol):
    """One mode's answers to "whose GPUs?" (see the module docstring)."""

    @property
    def mode(self) -> Mode:
        """The mode, as the JSON answers name it."""

    @property
    def reports_queue_place(self) -> bool:
        """Whether a waiting attach's progress carries its place in the agent's queue."""

    def of(self, kernel_id: KernelId | None) -> Target | None:
        """The target of a read or a stream for ``kernel_id``; ``None``: nobody's GPUs are
        asked for, only the node's. Raises ``HotplugError`` for a kernel that cannot be one
        (unknown, not sandboxed, not running)."""

    def required(self, kernel_id: KernelId | None, operation: str) -> Target:
        """The target of ``operation`` (attach, detach, cancel), which must act on someone."""

    def kernels_by_pid(self) -> Mapping[int, KernelId]:
        """This server's kernels that may hold GPUs, by the pid the agent names them with."""


class SandboxTargets:
    """Local mode: each kernel's sandbox, found through ``sandboxes``; a kernel must be named to
    change anything, and no kernel named reads only the node's counts."""

    mode: Final = "local"
    reports_queue_place: Final = True
    kernel_required: ClassVar[bool] = True

    def __init__(self, sandboxes: KernelSandboxes) -> None:
        self.sandboxes = sandboxes

    @classmethod
    def build(cls, sandboxes: KernelSandboxes) -> SandboxTargets:
        return cls(sandboxes)

    def of(self, kernel_id: KernelId | None) -> Target | None:
        if kernel_id is None:
            return None
        ref = PidRef(self.sandboxes.pid_of(kernel_id))
        return Target(ref=ref, scope=kernel_id, label=f"kernel {kernel_id} ({ref})")

    def required(self, kernel_id: KernelId | None, operation: str) -> Target:
        target = self.of(kernel_id)
        if target is None:
            raise KernelIdRequired(operation)
        return target

    def kernels_by_pid(self) -> Mapping[int, KernelId]:
        return self.sandboxes.kernels_by_pid()


class PodTargets:
    """Kubernetes mode: this notebook's pod, whatever kernel is named; its GPUs are every
    kernel's, so every stream sees every attach. The agent queues a pod's waiting attach as
    it queues a sandboxed kernel's (one queue, one decision: ``agent/core/admission.py``), and
    a wait this server started reads its place there (``GET /v1/queue`` with no target: the
    caller's own pod), so the toolbar says "queued #1" as in local mode. A wait started
    elsewhere in the pod (``%gpu attach --wait`` calls the agent from the kernel) is not read
    by the stream: the agent's queue names pods, not the kernels in them."""

    mode: Final = "kubernetes"
    reports_queue_place: Final = True
    kernel_required: ClassVar[bool] = False

    _POD: Final = Target(ref=None, scope=None, label="this pod")

    @classmethod
    def build(cls, sandboxes: KernelSandboxes) -> PodTargets:
        """The pod is known to the agent from the token: no kernel lookup is needed."""
        del sandboxes
        return cls()

    def of(self, kernel_id: KernelId | None) -> Target:
        return self._POD

    def required(self, kernel_id: KernelId | None, operation: str) -> Target:
        return self._POD

    def kernels_by_pid(self) -> Mapping[int, KernelId]:
        return {}


_STRATEGIES: Final[Mapping[Mode, type[SandboxTargets] | type[PodTargets]]] = {
    "local": SandboxTargets,
    "kubernetes": PodTargets,
}


def kernel_required(mode: Mode) -> bool:
    """Whether every operation of ``mode`` must name its kernel (the served API document
    says so, as the strategy enforces it)."""
    return _STRATEGIES[mode].kernel_required


def targets_for(mode: Mode, *, sandboxes: KernelSandboxes) -> Targets:
    """The strategy of ``mode``, built once with the server's kernel-sandbox lookup."""
    return _STRATEGIES[mode].build(sandboxes)
