"""Kernel sandboxes starting and stopping, announced to whoever keeps GPUs in step with them.

Boundary: plain values and a listener registry; no host mechanics, no Jupyter imports. The
sandbox kernel provisioner (:mod:`.provisioner`) emits; the server extension or a demo
subscribes. Kept apart from the provisioner so that subscribers never import the host
mechanics the provisioner sits on (the notebook side's layering forbids it).

Why it exists: a restart moves a kernel to a new sandbox with a new pid, and a GPU attached
to the old pid does not follow. The default needs no listener — the agent's reconciler
releases the GPUs of a target whose pid is gone, and the restarted kernel starts with
none — but a policy such as "re-attach after a restart" or "release at once" needs to know
when each sandbox starts and stops, with the pid the agent targets. jupyter_client's own
restart callbacks fire only for automatic restarts, per kernel manager, and know no pids.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

__all__ = [
    "KERNEL_SANDBOX_EVENTS",
    "SandboxEvent",
    "SandboxEventKind",
    "SandboxEvents",
    "SandboxListener",
]

log = logging.getLogger(__name__)


class SandboxEventKind(enum.Enum):
    STARTED = "started"
    """The kernel runs in a new sandbox (after a launch or a restart)."""
    STOPPED = "stopped"
    """The sandbox is gone: every process ended, its cgroups and device program removed."""


@dataclass(frozen=True)
class SandboxEvent:
    """One change in a kernel sandbox's life."""

    kind: SandboxEventKind
    kernel_id: str | None
    pid: int
    """The kernel process in the sandbox: the target the agent knows it by."""
    sandbox: str
    """The sandbox's name (its cgroup directory name)."""
    restart: bool
    """``stopped``: a new sandbox follows for the same kernel id; ``started``: this one
    replaces an earlier sandbox of the same kernel id."""


SandboxListener = Callable[[SandboxEvent], Awaitable[None] | None]
"""Called with each event on the server's event loop; a coroutine function is awaited."""


class SandboxEvents:
    """Listeners for kernel sandboxes starting and stopping.

    Listeners run in subscription order, each awaited before the next, while the kernel's
    launch or clean-up waits. A listener that fails is logged and disturbs neither the
    kernel's life cycle nor the other listeners.
    """

    def __init__(self) -> None:
        self._listeners: list[SandboxListener] = []

    def subscribe(self, listener: SandboxListener) -> Callable[[], None]:
        """Add ``listener``; returns the function that removes it again (idempotent)."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):  # Already removed.
                self._listeners.remove(listener)

        return unsubscribe

    async def emit(self, event: SandboxEvent) -> None:
        for listener in tuple(self._listeners):
            try:
                result = listener(event)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("kernel sandbox listener %r failed on %s", listener, event)


KERNEL_SANDBOX_EVENTS: Final = SandboxEvents()
"""The process-wide registry: every sandboxed kernel of this server announces itself here."""
