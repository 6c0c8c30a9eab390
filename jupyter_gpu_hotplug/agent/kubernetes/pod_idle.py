"""The idle policy's Kubernetes half: a pod's own idle period, and Events when it acts.

Why it exists: the platform decides per notebook how long an unused GPU may stay (a course's
pods get a short period, a research profile none beyond the agent's), and in Kubernetes the
place for such a per-pod decision is an annotation the spawner writes. Users cannot edit their
own pod's annotations, so the value is trusted — and still applied only when stricter than the
agent's setting (``BackendHooks.idle_period``), like a request's ``idle_release_seconds`` in local
mode. It is read from the node's live view at each pass, so it costs no API call.

Warnings and releases become Events on the pod (``kubectl describe pod``, the hub's event
stream), where a user who finds the GPU gone looks; the release itself went through the
ordinary detach, which deletes the holder pod and records ``GpuDetached`` as any detach.
"""

from __future__ import annotations

import logging
import math

from ..._structs import IDLE_RELEASE_ANNOTATION, PodTarget, Target
from ..core.idle import IdleReason, IdleRelease, IdleWarning
from .events import IDLE_RELEASED, IDLE_WARNING, PodEvents
from .node_pods import NodePods

__all__ = ["PodIdle"]

log = logging.getLogger(__name__)


class PodIdle:
    """Per-pod idle periods from the annotation, and the Events of the idle policy."""

    def __init__(self, pods: NodePods, events: PodEvents) -> None:
        self._pods = pods
        self._events = events
        self._complained: set[tuple[str, str, str]] = set()

    def idle_seconds(self, target: Target) -> float | None:
        """The pod's annotated idle period; ``None`` when it has none or it is unreadable."""
        if not isinstance(target, PodTarget):
            return None
        pod = self._pods.get(target.namespace, target.name)
        raw = (
            ((pod or {}).get("metadata") or {}).get("annotations", {}).get(IDLE_RELEASE_ANNOTATION)
        )
        if raw is None:
            return None
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds <= 0:
            key = (target.namespace, target.name, raw)
            if key not in self._complained:  # once, not at every pass
                self._complained.add(key)
                log.warning(
                    "pod %s/%s: %s=%r is not a positive number of seconds; ignored",
                    target.namespace,
                    target.name,
                    IDLE_RELEASE_ANNOTATION,
                    raw,
                )
            return None
        return seconds

    def announce(self, event: IdleWarning | IdleRelease) -> None:
        """An Event on the pod for a warning (type Warning) or a release (Normal)."""
        why = "unused for the idle period" if event.reason is IdleReason.IDLE else "lease ended"
        if isinstance(event, IdleWarning):
            at = event.release_at.strftime("%H:%M:%S UTC")
            message = f"GPU {event.uuid} will be released at {at} unless it is used ({why})"
            self._events.emit(event.target, IDLE_WARNING, message, warning=True)
        else:
            self._events.emit(event.target, IDLE_RELEASED, f"released GPU {event.uuid}: {why}")
