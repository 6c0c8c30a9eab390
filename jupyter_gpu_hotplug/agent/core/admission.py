"""The attach decision: serve now, queue, or refuse — one pure function over one availability.

Why it exists (issue 38, 1): the decision used to be assembled in pieces, from two authorities
on "free". The service counted NVML minus its own reservations, the Kubernetes allocator asked
PodResources, so on a node where the device plugin holds GPUs the two disagreed: a waiter woken
for a GPU a plugin pod held went round its turn again without waiting (a PodResources ``List``
per round until its deadline), and a request that could wait got 409 at once because the
allocator, not the queue, found too few. Now the service builds one ``Availability`` per
decision — free from ``Allocator.available`` only (local: the ledger's view of NVML's GPUs;
Kubernetes: PodResources), what the queue's head holds, the limits the backend resolved — and
``decide`` alone says what happens; the table in ``tests/agent/test_admission.py`` pins it.

The order of the rules is the contract: a count the node can never serve is refused first (409,
not retryable), then a limit (403: waiting would not help, so such a request is never queued
and never holds the head), then enough free beyond what the head holds is served, else a
request that may wait is queued and one that may not is refused (409, retryable). A request
already in the queue was checked against its limits when it joined (its count is part of what
its group holds), so at its turn only the node's GPUs are weighed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import AgentError, Forbidden, InsufficientGpus

__all__ = ["Availability", "Demand", "Limit", "Queue", "Refuse", "Serve", "decide"]


@dataclass(frozen=True)
class Limit:
    """The most GPUs a group (one container, or a pod's containers) may hold, and how many it
    holds now with what its waiting requests will take."""

    count: int
    held: int
    source: str | None = None
    """Which setting or annotation sets ``count`` (for the refusal); None: the agent's own
    per-container limit."""


@dataclass(frozen=True)
class Demand:
    """What a request asks for, as the decision sees it."""

    count: int
    may_wait: bool
    """It gave ``wait_seconds``."""
    waiting: bool = False
    """It is in the queue already (its limits were checked when it joined)."""


@dataclass(frozen=True)
class Availability:
    """The node as one decision sees it, read once."""

    total: int
    """How many GPUs of the kind asked for the node has in all (lost ones included); 0: not
    known to be too few (the request names its GPUs, checked elsewhere)."""
    free: int
    """How many of them are free now: ``Allocator.available``, the one authority."""
    held: int = 0
    """How many of ``free`` the queue's head holds against this request (``WaitQueue.held``)."""
    limits: tuple[Limit, ...] = ()


@dataclass(frozen=True)
class Serve:
    """Reserve and grant now."""


@dataclass(frozen=True)
class Queue:
    """Wait in the queue for the next change of the node."""


@dataclass(frozen=True)
class Refuse:
    """Answer ``error`` now; nothing was reserved or queued."""

    error: AgentError


Decision = Serve | Queue | Refuse


def decide(demand: Demand, availability: Availability) -> Decision:
    """Serve, queue or refuse ``demand`` given ``availability`` (the module docstring's order)."""
    count, free = demand.count, availability.free
    if 0 < availability.total < count:
        return Refuse(
            InsufficientGpus(
                free=free,
                requested=count,
                hint=f"that is more than this node's {availability.total} GPU(s) in all; ask "
                f"for at most {availability.total}, or list the node's GPUs to see them all",
                retryable=False,
            )
        )
    if not demand.waiting:
        for limit in availability.limits:
            if limit.held + count > limit.count:
                return Refuse(
                    Forbidden.over_gpu_limit(
                        limit=limit.count, attached=limit.held, requested=count, source=limit.source
                    )
                )
    if free - availability.held >= count:
        return Serve()
    if demand.may_wait or demand.waiting:
        return Queue()
    return Refuse(
        InsufficientGpus(
            free=free,
            requested=count,
            hint=f"{availability.held} of them held for the request first in the queue; ask "
            "with wait_seconds to wait for your turn"
            if availability.held
            else None,
        )
    )
