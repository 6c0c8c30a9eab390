"""A fair FIFO queue for attach requests that wait for GPUs on this node (every mode).

Why it exists: users who ask for a GPU when none is free should be served in the order they
asked, not by who retries fastest. An attach that gives ``wait_seconds`` and finds too few
GPUs it may take joins the queue. Each kind of request has its own order: whole GPUs, the
slices of each MIG profile (a freed slice serves no one who waits for a whole GPU), and the
GPUs a request names (it waits for those, and only they serve it).

Who is served (issue 25: a waiter for 2 GPUs with 1 free used to refuse everyone, "0 free"
while ``/v1/gpus`` showed one free): the *head* (first waiter of a kind) is served as soon as
enough are free. A request that fits in what is free — a later waiter, or one that does not
wait — is served while the head cannot be, and each such overtake is counted on the head.
The head is not starved: once it has been overtaken ``QUEUE_OVERTAKES`` times, or as soon as
enough are free for it, its count is *held* — nobody else may take those GPUs — so every GPU
freed from then on goes to it until it is served. A request refused because of that hold
hears so (409 ``insufficient_gpus`` with the node's real free count, the one ``/v1/gpus``
shows, and a hint naming the hold).

Fair share: one container may have at most ``MAX_WAITERS_PER_CONTAINER`` requests waiting;
another is refused at once (409 ``busy``, retryable), so one container cannot fill the queue.

Waking up: every release the agent makes (detach, idle release, reconciliation) calls
``notify``, which wakes every waiter at once; the first one finds its GPUs within that
scheduling step. In Kubernetes mode the backend also notifies when a pod of the node ends or
goes (a device-plugin pod's GPUs are then free). A waiter also looks again every ``recheck``
seconds by itself, which is when it notices that its target has gone (the notebook was closed:
it leaves the queue). Between two such moments a waiter does nothing: whether it is served is
``admission.decide``'s answer over ``Allocator.available``, asked once per wake-up, and a
waiter whose GPUs another took first (a device-plugin pod) waits for the next one.

Leaving: served (it got its GPUs), cancelled (``DELETE /v1/queue/{request_id}`` for its
target: the waiting ``POST`` answers ``insufficient_gpus`` saying so), deadline passed
(``504 timeout``), target gone (``404``). In every case nothing was reserved for it and
nothing is left behind.

Both modes use this queue, in the same way: in Kubernetes mode "free" is what the kubelet's
PodResources says (``Allocator.available``), so a request waits here while the device plugin's
pods hold the node's GPUs, and its holder pod is created only at its turn.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..._structs import MAX_WAITERS_PER_CONTAINER, QUEUE_OVERTAKES, RequestId, Target
from .errors import Busy, InsufficientGpus, NotFound, Timeout
from .seams import HostContainer

__all__ = ["WaitQueue", "Waiter"]

_RECHECK_SECONDS = 1.0


@dataclass(eq=False)
class Waiter:
    """One attach request in the queue."""

    container: HostContainer
    count: int
    request_id: RequestId
    """The request's own id, or one the agent made up: what ``DELETE /v1/queue/{id}`` names."""
    deadline: float
    """``time.monotonic()`` value after which the request answers 504."""
    queued_at: datetime
    kind: str | None = None
    """What it waits for: whole GPUs (``None``), slices of a MIG profile, or the GPUs it names
    (their UUIDs joined by ``,``; a profile never contains one); each kind has
    its own order (a slice freed serves no one waiting for a whole GPU)."""
    cancelled: bool = False
    overtaken: int = 0
    """Requests served before it while it was the head and could not be served."""
    number: int = 0
    """Arrival order (for logs)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def target(self) -> Target:
        return self.container.target


class WaitQueue:
    """The node's queue of waiting attach requests (see the module docstring)."""

    def __init__(
        self,
        *,
        recheck: float = _RECHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[int], None] = lambda length: None,
    ) -> None:
        self._waiters: list[Waiter] = []
        self._recheck = recheck
        self._clock = clock
        self._on_change = on_change
        self._numbers = itertools.count(1)

    def __len__(self) -> int:
        return len(self._waiters)

    @property
    def waiters(self) -> list[Waiter]:
        """In order: the first one is served next."""
        return list(self._waiters)

    def position(self, waiter: Waiter) -> int:
        """1 for the first waiter."""
        return self._waiters.index(waiter) + 1

    def head(self, kind: str | None = None) -> Waiter | None:
        """The first waiter of ``kind``: the one that is served as soon as enough are free."""
        return next((waiter for waiter in self._waiters if waiter.kind == kind), None)

    def held(self, kind: str | None, free: int, waiter: Waiter | None = None) -> int:
        """Of ``free`` GPUs of ``kind``, how many the head holds against ``waiter`` (None: a
        request that does not wait): its count once it could be served now or has been
        overtaken ``QUEUE_OVERTAKES`` times, else none (module docstring)."""
        head = self.head(kind)
        if head is None or head is waiter:
            return 0
        if free >= head.count or head.overtaken >= QUEUE_OVERTAKES:
            return head.count
        return 0

    def served(self, kind: str | None, waiter: Waiter | None) -> None:
        """A request of ``kind`` got its GPUs: one overtake more if it was not the head."""
        head = self.head(kind)
        if head is not None and head is not waiter:
            head.overtaken += 1

    def find(self, request_id: str) -> list[Waiter]:
        return [waiter for waiter in self._waiters if waiter.request_id == request_id]

    def join(
        self,
        container: HostContainer,
        count: int,
        *,
        request_id: RequestId | None,
        deadline: float,
        kind: str | None = None,
    ) -> Waiter:
        """Queue a request at the end. A request id already waiting for the same target is a
        retry of a request still in the queue: ``Busy`` (its answer is on its way); so is one
        more from a container that has ``MAX_WAITERS_PER_CONTAINER`` waiting."""
        if request_id is not None:
            for waiter in self.find(request_id):
                if waiter.target.key == container.target.key:
                    raise Busy(
                        f"request {request_id} for {container.target} is already waiting for "
                        f"GPUs (position {self.position(waiter)} of {len(self)})",
                        hint="wait for its answer, or cancel it with DELETE /v1/queue/"
                        f"{request_id}",
                    )
        mine = sum(1 for waiter in self._waiters if waiter.container.key == container.key)
        if mine >= MAX_WAITERS_PER_CONTAINER:
            raise Busy(
                f"{container} already waits with {mine} requests, the most one container may",
                hint="wait for one of them to be answered, or cancel one, then ask again",
                retryable=True,
            )
        waiter = Waiter(
            container=container,
            count=count,
            request_id=request_id or RequestId(f"queued-{secrets.token_hex(8)}"),
            deadline=deadline,
            kind=kind,
            queued_at=datetime.now(UTC),
            number=next(self._numbers),
        )
        self._waiters.append(waiter)
        self._on_change(len(self))
        return waiter

    def leave(self, waiter: Waiter) -> None:
        """Take ``waiter`` out (served, failed or cancelled) and let the next one look."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            self._on_change(len(self))
        self.notify()

    def cancel(self, waiter: Waiter) -> None:
        """Make ``waiter``'s request give up now (its ``POST`` answers that it was cancelled)."""
        waiter.cancelled = True
        waiter.changed.set()

    def notify(self) -> None:
        """GPUs were freed, or the queue changed: every waiter looks again now."""
        for waiter in self._waiters:
            waiter.changed.set()

    async def wait(
        self,
        waiter: Waiter,
        *,
        free: int,
        alive: Callable[[], Awaitable[bool]],
        wait_seconds: float,
    ) -> None:
        """Return at the next change since ``waiter`` last looked (``notify``: a release, the
        queue changed, the backend saw the node change), or after ``recheck`` seconds with its
        target still there; the caller then decides again (``admission.decide``). A change
        that came while the caller decided returns at once, so none is missed, and nothing
        returns early otherwise: a waiter whose GPUs another took first waits for the next
        change, it does not go round again (issue 38, 1(a)); a change that comes at the
        deadline still gets its decision. Raises, with the waiter still in the queue (the
        caller's ``leave`` removes it): ``InsufficientGpus`` when cancelled (``free``: what
        the caller last saw free), ``Timeout`` at the deadline, ``NotFound`` when ``alive()``
        says the target is gone."""
        changed = waiter.changed.is_set()
        remaining = waiter.deadline - self._clock()
        if not changed and remaining > 0 and not waiter.cancelled:
            try:
                await asyncio.wait_for(waiter.changed.wait(), min(remaining, self._recheck))
                changed = True
            except TimeoutError:
                if not await alive():
                    raise NotFound(
                        "process",
                        str(waiter.container.pid),
                        hint="the target exited while it waited for GPUs; nothing was left",
                    ) from None
        waiter.changed.clear()
        if waiter.cancelled:
            raise InsufficientGpus(
                free=free,
                requested=waiter.count,
                hint=f"the request was cancelled while it waited (id {waiter.request_id})",
            )
        if not changed and waiter.deadline - self._clock() <= 0:
            raise Timeout(
                f"no {waiter.count} GPU(s) became free for {waiter.target} within "
                f"{wait_seconds:g} s (it was number {self.position(waiter)} in the queue)",
                wait_seconds=wait_seconds,
                hint="nothing was left behind; try again later, or with a larger wait_seconds",
            )
