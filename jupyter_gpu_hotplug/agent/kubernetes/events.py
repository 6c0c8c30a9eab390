"""Kubernetes Events on target pods: what the agent did to a pod, where its users look
(``kubectl describe pod``, the hub's event stream).

Why fire-and-forget: an Event is a courtesy, not state. Writing one must neither slow an attach
down (it is an API round trip) nor fail it; ``emit`` schedules the write and returns, and
``drain`` lets the agent finish what is queued when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

from ..._structs import PodTarget, Target
from .kube import KubeApi
from .node_pods import NodePods

__all__ = [
    "ATTACHED",
    "DETACHED",
    "HOLDER_LOST",
    "IDLE_RELEASED",
    "IDLE_WARNING",
    "REINJECTED",
    "REVOKED",
    "STRAY_ACCESS",
    "UNTRUSTED_HOLDER",
    "PodEvents",
]

ATTACHED: Final = "GpuAttached"
DETACHED: Final = "GpuDetached"
REINJECTED: Final = "GpuReinjected"
REVOKED: Final = "GpuRevoked"
HOLDER_LOST: Final = "GpuHolderLost"
STRAY_ACCESS: Final = "GpuStrayAccess"
IDLE_WARNING: Final = "GpuIdleWarning"
IDLE_RELEASED: Final = "GpuIdleReleased"
UNTRUSTED_HOLDER: Final = "GpuHolderUntrusted"


class PodEvents:
    """Events on pods of this node (the pod object comes from the node's live view)."""

    def __init__(self, kube: KubeApi, pods: NodePods) -> None:
        self._kube = kube
        self._pods = pods
        self._pending: set[asyncio.Task[None]] = set()

    def emit(self, target: Target, reason: str, message: str, *, warning: bool = False) -> None:
        if not isinstance(target, PodTarget):
            return
        pod = self._pods.get(target.namespace, target.name)
        if pod is None:
            return
        task = asyncio.get_running_loop().create_task(
            self._kube.create_event(pod, reason=reason, message=message, warning=warning)
        )
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def drain(self, timeout: float = 5.0) -> None:
        if self._pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*self._pending), timeout)
