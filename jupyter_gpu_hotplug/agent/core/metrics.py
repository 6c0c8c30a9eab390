"""The agent's Prometheus metrics, in a registry of its own.

Why a registry of its own: the process-global default registry would mix in whatever else the
process imports, and two agents in one test process would collide on metric names. Everything
the agent exports is declared here, once, so the names are reviewable in one place:

- ``gpu_hotplug_attach_total{result}`` / ``gpu_hotplug_detach_total{result}``: operations by
  outcome (``success`` or the API error code);
- ``gpu_hotplug_attach_duration_seconds`` / ``gpu_hotplug_detach_duration_seconds``: latency
  of whole operations as the service sees them (histograms);
- ``gpu_hotplug_gpus{state}``: GPUs by state (``free``, ``attached``, ``allocated``: held by
  a pod through the device plugin, ``lost``), as of the last inventory read;
- ``gpu_hotplug_operations_in_flight``: attaches and detaches running now;
- ``gpu_hotplug_queue_length``: attach requests waiting for GPUs now;
- ``gpu_hotplug_reconcile_actions_total{action}``: what reconciliation had to repair;
- ``gpu_hotplug_idle_warnings_total{reason}`` / ``gpu_hotplug_idle_releases_total{reason}``:
  announced and done releases of unused GPUs by the idle policy (``idle`` or ``lease``);
- ``gpu_hotplug_lost_revokes_total{kind}``: GPUs revoked after a lost reservation's grace
  period: ``holder`` (a holder pod preempted, evicted, deleted) or ``orphan`` (a grant of ours
  that no reservation backs, found by the sweep at start-up and on every reconciliation);
- ``gpu_hotplug_stray_gpu_access``: GPUs that running containers can open although neither
  the device plugin nor the agent gave them (as of the last sweep; Kubernetes mode);
- ``gpu_hotplug_untrusted_holders_total{reason}``: holder pods the agent did not believe
  (forged, patched, claiming a GPU another holds: ``kubernetes/trust.py`` names the reasons);
  each is counted once per agent start;
- ``gpu_hotplug_http_requests_total{method,route,status}``: every API response;
- ``gpu_hotplug_simulated``: 1 when the GPUs are simulated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, Generic, TypeVar, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE", "GPU_STATES", "AgentMetrics"]

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST
GPU_STATES: Final = ("free", "attached", "allocated", "lost")

# Local attaches take milliseconds; Kubernetes ones wait for a holder pod (seconds).
_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

_M = TypeVar("_M", Counter, Gauge, Histogram)


class _Family(Generic[_M]):
    """One metric family, declared once on ``AgentMetrics`` (its name, help and labels, as
    data) and made afresh in each agent's own registry: the class body is the reviewable list
    of everything exported, and ``__init__`` only makes what it declares."""

    def __init__(self, make: Callable[[CollectorRegistry], _M]) -> None:
        self.make: Callable[[CollectorRegistry], _M] = make
        """Makes the family in one agent's registry."""

    def __set_name__(self, owner: type, attribute: str) -> None:
        self._attribute = attribute

    @overload
    def __get__(self, instance: None, owner: type) -> _Family[_M]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> _M: ...
    def __get__(self, instance: object | None, owner: type) -> _Family[_M] | _M:
        # What makes ``metrics.attach_total`` a ``Counter`` to the type checker; at run time
        # the agent's own family, set in ``__init__``, is found in the instance first.
        if instance is None:
            return self
        made: _M = vars(instance)[self._attribute]
        return made


def _counter(name: str, documentation: str, *labels: str) -> _Family[Counter]:
    """A counter (exported as ``<name>_total``)."""
    return _Family(lambda registry: Counter(name, documentation, labels, registry=registry))


def _gauge(name: str, documentation: str, *labels: str) -> _Family[Gauge]:
    """A gauge: a value as of now (a count, a state)."""
    return _Family(lambda registry: Gauge(name, documentation, labels, registry=registry))


def _histogram(name: str, documentation: str) -> _Family[Histogram]:
    """A latency histogram over ``_BUCKETS``."""
    return _Family(
        lambda registry: Histogram(name, documentation, buckets=_BUCKETS, registry=registry)
    )


class AgentMetrics:
    """The metrics of one agent: every family is declared below, in the order it is exported."""

    attach_total = _counter(
        "gpu_hotplug_attach",
        "Attach operations by result (success or the API error code).",
        "result",
    )
    detach_total = _counter(
        "gpu_hotplug_detach",
        "Detach operations (one per GPU) by result (success or the API error code).",
        "result",
    )
    attach_duration = _histogram(
        "gpu_hotplug_attach_duration_seconds",
        "Time to attach GPUs, from the validated request to the recorded grant.",
    )
    detach_duration = _histogram(
        "gpu_hotplug_detach_duration_seconds",
        "Time to detach one GPU, from the validated request to the released record.",
    )
    gpus = _gauge(
        "gpu_hotplug_gpus", "GPUs of this node by state, as of the last inventory read.", "state"
    )
    in_flight = _gauge(
        "gpu_hotplug_operations_in_flight", "Attach and detach operations running now."
    )
    queue_length = _gauge(
        "gpu_hotplug_queue_length", "Attach requests waiting in the queue for free GPUs now."
    )
    reconcile_actions = _counter(
        "gpu_hotplug_reconcile_actions",
        "Repairs made by reconciliation (released, regranted, revoked, finished, ...).",
        "action",
    )
    idle_warnings = _counter(
        "gpu_hotplug_idle_warnings",
        "Releases of unused GPUs announced by the idle policy, by reason (idle, lease).",
        "reason",
    )
    idle_releases = _counter(
        "gpu_hotplug_idle_releases",
        "GPUs released by the idle policy, by reason (idle, lease).",
        "reason",
    )
    lost_revokes = _counter(
        "gpu_hotplug_lost_revokes",
        "GPUs revoked after a lost reservation's grace period, by kind (holder, orphan).",
        "kind",
    )
    stray_gpu_access = _gauge(
        "gpu_hotplug_stray_gpu_access",
        "GPUs that running containers can open without the device plugin or the agent "
        "giving them, as of the last sweep.",
    )
    untrusted_holders = _counter(
        "gpu_hotplug_untrusted_holders",
        "Holder pods not believed (their GPU granted to no one on their word), by reason.",
        "reason",
    )
    http_requests = _counter(
        "gpu_hotplug_http_requests",
        "API responses by method, route and status.",
        "method",
        "route",
        "status",
    )
    simulated = _gauge(
        "gpu_hotplug_simulated", "1 when this agent's GPUs are simulated (no hardware behind them)."
    )

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        for attribute, family in vars(AgentMetrics).items():
            if isinstance(family, _Family):
                setattr(self, attribute, family.make(self.registry))
        # Series that exist before anything happened, so a rate or an alert sees a 0.
        for state in GPU_STATES:
            self.gpus.labels(state=state).set(0)
        for counter in (self.attach_total, self.detach_total):
            counter.labels(result="success")
        for kind in ("holder", "orphan"):
            self.lost_revokes.labels(kind=kind)

    def set_gpu_counts(self, counts: Mapping[str, int]) -> None:
        """Replace the per-state GPU counts (states not given become 0)."""
        for state in GPU_STATES:
            self.gpus.labels(state=state).set(counts.get(state, 0))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
