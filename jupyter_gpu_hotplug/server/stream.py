"""The live stream's machinery: subscriptions, their events, one shared poller, and progress.

Boundary: asyncio only. A ``Subscription`` holds the events of one open stream — the latest
``metrics`` (or ``error``) reading of its kernel and the ``progress`` events of attaches —
until it is closed. The ``EventHub`` owns the open subscriptions and the one ``poll`` loop of
this server: every interval it asks a callable the manager gives it for a reading of every
kernel that has a stream open (all of them at once), then hands each subscription its
kernel's part. Encoding follows the server-sent events format. Nothing here knows about
tornado or the agent.

Why one shared poller rather than a read per stream: the cost upstream (agent requests, NVML
reads) must not grow with the number of browser tabs. Fifty tabs on one notebook used to mean
fifty streams each asking the agent twice a second; now the server asks once per interval
for the node and once per *kernel* watched, and every stream of that kernel gets the same
reading. The poller runs only while at least one stream is open (started by the first
subscriber, cancelled when the last leaves), so an idle server reads nothing.

Why the latest reading replaces an unsent one: a slow client must not make the server queue
readings for it. Progress is different — each event matters — so it is queued per stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from .errors import AgentNotAnswering, error_reply
from .models import GpusJson, ProgressJson

__all__ = ["STREAM_PREAMBLE", "EventHub", "Reading", "StreamEvent", "Subscription"]

log = logging.getLogger(__name__)

SILENT_AFTER_MIN: Final = 5.0
"""Seconds a reading may take before the streams hear that the agent is silent (at least)."""
RECONNECT_MS: Final = 5000
STREAM_PREAMBLE: Final = f"retry: {RECONNECT_MS}\n\n".encode()
"""Sent first: tells an ``EventSource`` to reconnect after 5 s if the stream breaks."""

EventKind = Literal["metrics", "progress", "error"]

Reading = Mapping[str | None, GpusJson | BaseException]
"""One poll: for each kernel id asked about (``None``: no kernel), its view or its failure."""

ReadAll = Callable[[frozenset[str | None]], Coroutine[Any, Any, Reading]]


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

    ``key``: the kernel whose readings it gets (``None``: the node's counts only). ``scope``:
    whose progress it receives (``None``: everyone's).
    """

    def __init__(self, *, key: str | None, scope: str | None) -> None:
        self.key = key
        self.scope = scope
        self._progress: collections.deque[StreamEvent] = collections.deque()
        self._reading: StreamEvent | None = None
        self._wake = asyncio.Event()
        self._closed = False
        self.task: asyncio.Task[object] | None = None
        """The task reading this stream (set at the first ``next()``), for shutdown and tests."""

    @property
    def closed(self) -> bool:
        return self._closed

    def wants(self, scope: str | None) -> bool:
        """Whether progress of ``scope`` belongs on this stream."""
        return self.scope is None or self.scope == scope

    def deliver(self, event: StreamEvent) -> None:
        """Queue a progress event."""
        if not self._closed:
            self._progress.append(event)
            self._wake.set()

    def offer(self, event: StreamEvent) -> None:
        """The newest reading (``metrics`` or ``error``); replaces one not yet sent."""
        if not self._closed:
            self._reading = event
            self._wake.set()

    def close(self) -> None:
        """End the stream after the events already held: ``next()`` returns those, then
        ``None``. Idempotent."""
        self._closed = True
        self._wake.set()

    async def next(self) -> StreamEvent | None:
        """The next event, or ``None`` once the stream is closed and drained."""
        if self.task is None:
            self.task = asyncio.current_task()
        while True:
            if self._progress:
                return self._progress.popleft()
            if self._reading is not None:
                event, self._reading = self._reading, None
                return event
            if self._closed:
                return None
            self._wake.clear()
            await self._wake.wait()


class EventHub:
    """The open streams, the one poller that feeds them, and the progress of attaches.

    ``read``: one reading of every kernel asked about. ``interval``: seconds between two
    polls. ``ends_stream``: failures after which a stream ends (its subject is gone) instead of
    reporting the error and going on. ``silent_after``: seconds a reading may take before
    every stream is told the agent is not answering (``AgentNotAnswering``, repeated each
    interval while the same reading still waits; default: three intervals, at least 5 s).
    A stream that opens while an attach is in flight first
    receives that attach's latest progress, so a reloaded page still sees it finish.
    """

    def __init__(
        self,
        *,
        read: ReadAll,
        interval: float,
        ends_stream: tuple[type[BaseException], ...] = (),
        silent_after: float | None = None,
    ) -> None:
        self._read = read
        self._interval = interval
        self._silent_after = (
            max(SILENT_AFTER_MIN, 3 * interval) if silent_after is None else silent_after
        )
        self._ends_stream = ends_stream
        self._subscriptions: set[Subscription] = set()
        self._in_flight: dict[str, tuple[str | None, StreamEvent]] = {}
        self._latest: dict[str | None, StreamEvent] = {}
        self._poller: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self.polls = 0
        """How many polls the poller has made (for tests and benchmarks)."""

    @property
    def subscriptions(self) -> frozenset[Subscription]:
        return frozenset(self._subscriptions)

    @property
    def polling(self) -> bool:
        """Whether the poller runs (it does exactly while a stream is open)."""
        return self._poller is not None and not self._poller.done()

    def add(self, subscription: Subscription) -> None:
        for scope, event in self._in_flight.values():
            if subscription.wants(scope):
                subscription.deliver(event)
        self._subscriptions.add(subscription)
        self._empty.clear()
        latest = self._latest.get(subscription.key)
        if latest is not None:
            subscription.offer(latest)
        else:
            self._kick.set()  # a kernel nobody watched yet: read it now, not in a second
        if not self.polling:
            self._poller = asyncio.create_task(self._poll(), name="gpu-hotplug-stream-poller")

    def remove(self, subscription: Subscription) -> None:
        subscription.close()
        self._subscriptions.discard(subscription)
        if not self._subscriptions:
            self._empty.set()
            self._stop_polling()

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
        poller = self._stop_polling()
        if poller is not None:
            await asyncio.wait({poller})
        try:
            async with asyncio.timeout(timeout):
                await self._empty.wait()
        except TimeoutError:
            log.warning(
                "%d GPU stream(s) still open %g s after the server began to stop",
                len(self._subscriptions),
                timeout,
            )

    def _stop_polling(self) -> asyncio.Task[None] | None:
        poller, self._poller = self._poller, None
        self._latest.clear()
        if poller is not None:
            poller.cancel()
        return poller

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        while self._subscriptions:
            started = loop.time()
            self._kick.clear()
            keys = frozenset(subscription.key for subscription in self._subscriptions)
            try:
                reading = await self._read_or_report_silence(keys)
            except Exception as error:  # the reader's own failure: every stream hears of it
                reading = dict.fromkeys(keys, error)
            self.polls += 1
            self._fan_out(reading)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, started + self._interval - loop.time())):
                    await self._kick.wait()

    async def _read_or_report_silence(self, keys: frozenset[str | None]) -> Reading:
        """One reading; while it waits past ``silent_after``, every open stream is told so,
        once per interval. The reading is not abandoned: asking again would only wait
        again, and its answer (or its error) is the truth once it comes."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        read = asyncio.ensure_future(self._read(keys))
        try:
            timeout = self._silent_after
            while not (await asyncio.wait({read}, timeout=timeout))[0]:
                silent = AgentNotAnswering(seconds=loop.time() - started)
                watched = frozenset(subscription.key for subscription in self._subscriptions)
                self._fan_out(dict.fromkeys(watched | keys, silent))
                timeout = self._interval
            return read.result()
        finally:
            if not read.done():
                read.cancel()
                await asyncio.wait({read})  # its cancellation, never raised here

    def _fan_out(self, reading: Reading) -> None:
        events: dict[str | None, StreamEvent] = {}
        for key, result in reading.items():
            if isinstance(result, BaseException):
                reply = error_reply(result)
                if reply is None:  # a bug: logged with its traceback; the streams end
                    log.error("reading GPUs for the live stream failed", exc_info=result)
                    continue
                events[key] = StreamEvent("error", {**reply.body, "status": reply.status})
            else:
                events[key] = StreamEvent("metrics", result)
        self._latest = events
        for subscription in list(self._subscriptions):
            event = events.get(subscription.key)
            if event is None:
                if subscription.key in reading:  # the bug above
                    subscription.close()
                continue  # opened while this poll ran: the next one includes it
            subscription.offer(event)
            failure = reading[subscription.key]
            if isinstance(failure, self._ends_stream):
                subscription.close()
