"""The live stream's machinery: subscriptions, their events, and the hub that routes progress.

Boundary: asyncio only. A ``Subscription`` produces the events of one open stream — a
``metrics`` event every interval (computed on demand by a callable the manager gives it),
the ``progress`` events the ``EventHub`` delivers, and an ``error`` event when the metrics
cannot be read — until it is closed. Encoding follows the server-sent events format. Nothing
here knows about tornado or the agent.

Why pull rather than push for metrics: each stream reads metrics only when it is about to
send them, so an idle server with no open stream reads nothing, and a slow client delays
only its own stream. Progress is pushed (a queue per subscription) because it happens at
moments the stream cannot predict.

Why no background tasks: a stream's events are produced in the task of the request that
reads them (the tornado handler), which ends when the client disconnects or the server
stops; the only task created here is the one reading metrics, which a close cancels — so a
closed stream leaves nothing running (the tests check that the handler's task has ended).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from .errors import error_reply
from .models import GpusJson, ProgressJson

__all__ = ["STREAM_PREAMBLE", "EventHub", "StreamEvent", "Subscription"]

log = logging.getLogger(__name__)

RECONNECT_MS: Final = 5000
STREAM_PREAMBLE: Final = f"retry: {RECONNECT_MS}\n\n".encode()
"""Sent first: tells an ``EventSource`` to reconnect after 5 s if the stream breaks."""

EventKind = Literal["metrics", "progress", "error"]


@dataclass(frozen=True)
class StreamEvent:
    """One server-sent event: ``kind`` is its ``event:`` name, ``data`` its JSON."""

    kind: EventKind
    data: Mapping[str, object]

    def encode(self) -> bytes:
        # One line of JSON per event (json.dumps escapes newlines inside strings).
        payload = json.dumps(self.data, separators=(",", ":"))
        return f"event: {self.kind}\ndata: {payload}\n\n".encode()


class Subscription:
    """One open stream. Read it with ``next()`` until that returns ``None``; ``close()`` ends it.

    ``scope``: whose progress it receives (``None``: everyone's). ``view``: reads the metrics.
    ``ends_stream``: errors after which the stream ends (its subject is gone) instead of
    reporting the error and trying again at the next interval.
    """

    def __init__(
        self,
        *,
        scope: str | None,
        view: Callable[[], Coroutine[Any, Any, GpusJson]],
        interval: float,
        ends_stream: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.scope = scope
        self._view = view
        self._interval = interval
        self._ends_stream = ends_stream
        self._queue: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
        self._closed = False
        self._reading: asyncio.Task[GpusJson] | None = None
        self._next_metrics: float | None = None
        self.task: asyncio.Task[object] | None = None
        """The task reading this stream (set at the first ``next()``), for shutdown and tests."""

    @property
    def closed(self) -> bool:
        return self._closed

    def wants(self, scope: str | None) -> bool:
        """Whether progress of ``scope`` belongs on this stream."""
        return self.scope is None or self.scope == scope

    def deliver(self, event: StreamEvent) -> None:
        if not self._closed:
            self._queue.put_nowait(event)

    def close(self) -> None:
        """End the stream after the events already queued: ``next()`` returns those, then
        ``None``. A metrics read in flight is cancelled. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reading is not None:
            self._reading.cancel()
        self._queue.put_nowait(None)

    async def next(self) -> StreamEvent | None:
        """The next event, or ``None`` once the stream is closed and drained."""
        if self.task is None:
            self.task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        while not self._closed:
            due = self._next_metrics
            if due is None or loop.time() >= due:
                event = await self._metrics()
                self._next_metrics = loop.time() + self._interval
                if event is not None:
                    return event
                continue
            try:
                async with asyncio.timeout(due - loop.time()):
                    queued = await self._queue.get()
            except TimeoutError:
                continue
            if queued is not None:
                return queued
        return None if self._queue.empty() else self._queue.get_nowait()

    async def _metrics(self) -> StreamEvent | None:
        """A ``metrics`` or ``error`` event; ``None`` when the stream was closed meanwhile."""
        reading = asyncio.create_task(self._view())
        self._reading = reading
        try:
            # wait() rather than await: a close() cancels the reading, not this task.
            await asyncio.wait({reading})
        finally:
            self._reading = None
            if not reading.done():
                reading.cancel()
        if reading.cancelled():
            return None
        error = reading.exception()
        if error is None:
            return StreamEvent("metrics", reading.result())
        reply = error_reply(error)
        if reply is None:
            raise error  # a bug: the stream breaks and the server logs it
        if isinstance(error, self._ends_stream):
            self.close()
        return StreamEvent("error", {**reply.body, "status": reply.status})


class EventHub:
    """The open streams, and the progress of attaches in flight.

    A stream that opens while an attach is in flight first receives that attach's latest
    progress, so a reloaded page still sees it finish.
    """

    def __init__(self) -> None:
        self._subscriptions: set[Subscription] = set()
        self._in_flight: dict[str, tuple[str | None, StreamEvent]] = {}
        self._empty = asyncio.Event()
        self._empty.set()

    @property
    def subscriptions(self) -> frozenset[Subscription]:
        return frozenset(self._subscriptions)

    def add(self, subscription: Subscription) -> None:
        for scope, event in self._in_flight.values():
            if subscription.wants(scope):
                subscription.deliver(event)
        self._subscriptions.add(subscription)
        self._empty.clear()

    def remove(self, subscription: Subscription) -> None:
        subscription.close()
        self._subscriptions.discard(subscription)
        if not self._subscriptions:
            self._empty.set()

    def publish(self, progress: ProgressJson, *, scope: str | None) -> None:
        """Send ``progress`` to every stream that wants ``scope``."""
        event = StreamEvent("progress", progress)
        if progress["state"] in ("attached", "failed"):
            self._in_flight.pop(progress["request_id"], None)
        else:
            self._in_flight[progress["request_id"]] = (scope, event)
        for subscription in self._subscriptions:
            if subscription.wants(scope):
                subscription.deliver(event)

    async def close(self, *, timeout: float) -> None:
        """Close every stream and wait (up to ``timeout`` s) until their readers are done."""
        for subscription in self._subscriptions:
            subscription.close()
        try:
            async with asyncio.timeout(timeout):
                await self._empty.wait()
        except TimeoutError:
            log.warning(
                "%d GPU stream(s) still open %g s after the server began to stop",
                len(self._subscriptions),
                timeout,
            )
