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

from collections.abc import Mapping
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE", "GPU_STATES", "AgentMetrics"]

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST
GPU_STATES: Final = ("free", "attached", "allocated", "lost")

# Local attaches take milliseconds; Kubernetes ones wait for a holder pod (seconds).
_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class AgentMetrics:
    """The metrics of one agent."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.attach_total = Counter(
            "gpu_hotplug_attach",
            "Attach operations by result (success or the API error code).",
            ["result"],
            registry=self.registry,
        )
        self.detach_total = Counter(
            "gpu_hotplug_detach",
            "Detach operations (one per GPU) by result (success or the API error code).",
            ["result"],
            registry=self.registry,
        )
        self.attach_duration = Histogram(
            "gpu_hotplug_attach_duration_seconds",
            "Time to attach GPUs, from the validated request to the recorded grant.",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.detach_duration = Histogram(
            "gpu_hotplug_detach_duration_seconds",
            "Time to detach one GPU, from the validated request to the released record.",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.gpus = Gauge(
            "gpu_hotplug_gpus",
            "GPUs of this node by state, as of the last inventory read.",
            ["state"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "gpu_hotplug_operations_in_flight",
            "Attach and detach operations running now.",
            registry=self.registry,
        )
        self.queue_length = Gauge(
            "gpu_hotplug_queue_length",
            "Attach requests waiting in the queue for free GPUs now.",
            registry=self.registry,
        )
        self.reconcile_actions = Counter(
            "gpu_hotplug_reconcile_actions",
            "Repairs made by reconciliation (released, regranted, revoked, finished, ...).",
            ["action"],
            registry=self.registry,
        )
        self.idle_warnings = Counter(
            "gpu_hotplug_idle_warnings",
            "Releases of unused GPUs announced by the idle policy, by reason (idle, lease).",
            ["reason"],
            registry=self.registry,
        )
        self.idle_releases = Counter(
            "gpu_hotplug_idle_releases",
            "GPUs released by the idle policy, by reason (idle, lease).",
            ["reason"],
            registry=self.registry,
        )
        self.lost_revokes = Counter(
            "gpu_hotplug_lost_revokes",
            "GPUs revoked after a lost reservation's grace period, by kind (holder, orphan).",
            ["kind"],
            registry=self.registry,
        )
        self.stray_gpu_access = Gauge(
            "gpu_hotplug_stray_gpu_access",
            "GPUs that running containers can open without the device plugin or the agent "
            "giving them, as of the last sweep.",
            registry=self.registry,
        )
        self.untrusted_holders = Counter(
            "gpu_hotplug_untrusted_holders",
            "Holder pods not believed (their GPU granted to no one on their word), by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.http_requests = Counter(
            "gpu_hotplug_http_requests",
            "API responses by method, route and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.simulated = Gauge(
            "gpu_hotplug_simulated",
            "1 when this agent's GPUs are simulated (no hardware behind them).",
            registry=self.registry,
        )
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
