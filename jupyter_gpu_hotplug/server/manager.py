"""The server extension's logic: whose GPUs, asked of the agent, joined with live metrics.

Boundary: everything between a parsed request and its JSON answer — asking the mode's
targets strategy (``targeting``: local mode, the kernel's sandbox; Kubernetes, this pod,
which the agent knows from the token) whom to act on, calling the agent through
``AsyncAgentClient``, reading NVML off the event loop, publishing attach progress, and the
streams' life. It raises only ``errors.HotplugError`` and the client's
``AgentClientError``s; turning those into HTTP is the handlers' business.

Why a manager: handlers stay a few lines each (parse, call, answer), the way
jupyter_server's services are written, and the same operations serve the REST API and the
live stream, so both always agree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, cast

from .._structs import PidRef, RequestId
from ..client import (
    AgentClientError,
    AsyncAgentClient,
    Attachment,
    AttachmentState,
    Gpu,
    plain_free,
)
from ..nvml.attribution import ProcessTree
from ..nvml.state import GpuMonitor, Snapshot
from .attribution import AttributionJson, GpuAttributionJson, attribution_json
from .errors import (
    GpuNotAttached,
    HotplugError,
    KernelNotFound,
    RequestNotWaiting,
    ShuttingDown,
    error_reply,
    internal_error_reply,
)
from .history import GpuHistory, HistoryJson
from .kernel_sandboxes import KernelSandboxes
from .models import (
    AttachJson,
    GpusJson,
    KernelHolder,
    Mode,
    ProgressJson,
    ProgressState,
    WaitingAttach,
    attachment_json,
    gpus_json,
)
from .releases import ReleaseLog
from .stream import EventHub, Reading, Subscription
from .targeting import Target, Targets, targets_for
from .validation import AttachRequest, CancelRequest, DetachRequest, KernelId

__all__ = ["HotplugManager"]

AGENT_QUEUE_EVERY: Final = 5
"""With GPUs free and no wait seen, a watched kernel's queue is read every 5th reading."""
AGENT_QUEUE_EVERY_NONE_FREE: Final = 2
"""With no GPU free and no wait seen, every 2nd reading."""
STREAM_CLOSE_TIMEOUT: Final = 5.0
"""Seconds the server's shutdown waits for open streams to end."""

NotebookPaths = Callable[[], Awaitable[Mapping[str, str]]]
"""Kernel id → the path of its notebook, for the kernels that have a notebook session."""


async def _settle(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel what is still running of ``tasks``, wait until it has ended, and mark the
    failures of the others as seen: the caller has already raised the one that matters."""
    present = [task for task in tasks if task is not None]
    pending = [task for task in present if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    for task in present:
        if not task.cancelled():
            task.exception()


class _Progress:
    """The progress events of one attach."""

    def __init__(
        self,
        hub: EventHub,
        *,
        request_id: RequestId,
        kernel_id: KernelId | None,
        count: int,
        scope: str | None,
    ) -> None:
        self._hub = hub
        self._request_id = request_id
        self._kernel_id = kernel_id
        self._count = count
        self._scope = scope
        self._started = time.monotonic()

    def publish(self, state: ProgressState, **details: object) -> None:
        progress = ProgressJson(
            request_id=self._request_id,
            kernel_id=self._kernel_id,
            state=state,
            count=self._count,
            elapsed=round(time.monotonic() - self._started, 3),
        )
        progress.update(details)  # type: ignore[typeddict-item]
        self._hub.publish(progress, scope=self._scope)


class HotplugManager:
    """The operations behind the REST API (see the module docstring).

    ``client``: the agent. ``sandboxes``: kernel id → sandbox pid (used by local mode's
    targets). ``mode``: picks the targets strategy, once (``targeting``). ``monitor``:
    this process's NVML view; its blocking calls run in a thread of their own. ``interval``:
    seconds between two ``metrics`` events of a stream, and between two ``waiting`` events of
    an attach in flight. ``max_count``: the most GPUs one request may ask for.
    ``notebooks``: kernel id → notebook path (the server's sessions), so that local mode's
    holders and every mode's attribution are named by their notebooks.
    """

    def __init__(
        self,
        *,
        client: AsyncAgentClient,
        sandboxes: KernelSandboxes,
        monitor: GpuMonitor,
        mode: Mode,
        interval: float,
        max_count: int,
        log: logging.Logger | logging.LoggerAdapter[logging.Logger],
        notebooks: NotebookPaths | None = None,
    ) -> None:
        self.client = client
        self._notebooks = notebooks
        self.sandboxes = sandboxes
        self.targets: Targets = targets_for(mode, sandboxes=sandboxes)
        self.interval = interval
        self.max_count = max_count
        self._monitor = monitor
        self._log = log
        self._nvml = ThreadPoolExecutor(1, thread_name_prefix="gpu-hotplug-nvml")
        self._hub = EventHub(
            read=self.read, interval=interval, ends_stream=(KernelNotFound, ShuttingDown)
        )
        self._calls: set[asyncio.Task[tuple[Attachment, ...]]] = set()
        self._waiting: dict[RequestId, WaitingAttach] = {}
        """This server's attaches waiting for GPUs (``wait_seconds``): the panel's queue."""
        self._agent_waits: dict[str | None, tuple[float, tuple[WaitingAttach, ...]]] = {}
        """Watched kernels' waits in the agent's queue that this server did not start
        (``%gpu attach --wait``, the command line), with when they were read: one queue in
        every view."""
        self._queue_polls = 0
        self._history = GpuHistory()
        """The node's readings of the last hour (``GET history``): the charts' history."""
        self._releases = ReleaseLog()
        """Why watched kernels lost GPUs lately (each reading's ``released``)."""
        self._closed = False

    @property
    def mode(self) -> Mode:
        """The mode of the targets strategy (the answers and the API document name it)."""
        return self.targets.mode

    @property
    def subscriptions(self) -> frozenset[Subscription]:
        """The streams open now."""
        return self._hub.subscriptions

    @property
    def hub(self) -> EventHub:
        """The streams and their shared poller (tests and benchmarks count its polls)."""
        return self._hub

    def _check_open(self) -> None:
        if self._closed:
            raise ShuttingDown()

    # --- reading -------------------------------------------------------------------------------

    async def _snapshot(self) -> Snapshot:
        self._check_open()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._nvml, self._monitor.snapshot)

    async def _notebook_paths(self) -> Mapping[str, str]:
        """Kernel id → notebook path; empty when the sessions cannot be read (a label only:
        the answer must not fail for want of one)."""
        if self._notebooks is None:
            return {}
        try:
            return await self._notebooks()
        except Exception as error:
            self._log.warning("cannot read the notebook sessions: %r", error)
            return {}

    @staticmethod
    def _named(by_pid: Mapping[int, KernelId], paths: Mapping[str, str]) -> dict[int, KernelHolder]:
        return {
            pid: KernelHolder(kernel_id=kernel_id, path=paths.get(kernel_id))
            for pid, kernel_id in by_pid.items()
        }

    def _kernel_holders(self, paths: Mapping[str, str]) -> dict[int, KernelHolder]:
        """This server's kernels that may hold GPUs, by pid, with their notebooks (none in
        Kubernetes mode). Kernels whose session cannot be read are named by their ids."""
        return self._named(self.targets.kernels_by_pid(), paths)

    async def _attribution(
        self, snapshot: Snapshot, paths: Mapping[str, str]
    ) -> list[GpuAttributionJson]:
        """Which kernel uses how much of each GPU of ``snapshot`` (``attribution``): every
        kernel of this server, sandboxed or not, by its outermost process. The ``/proc`` walk
        runs beside the NVML reads, off the event loop."""
        kernels = self._named(self.sandboxes.kernel_processes(), paths)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._nvml,
            lambda: attribution_json(snapshot, kernels, server_pid=os.getpid(), tree=ProcessTree()),
        )

    async def attribution(self) -> AttributionJson:
        """``GET attribution``: the GPUs this server sees, each by kernel."""
        snapshot = await self._snapshot()
        gpus = await self._attribution(snapshot, await self._notebook_paths())
        return AttributionJson(gpus=gpus, taken_at=snapshot.taken_at)

    async def gpus(self, kernel_id: KernelId | None) -> GpusJson:
        """The target's GPUs with live metrics, the node's GPUs with who holds them, and
        the free and total counts."""
        result = (await self.read(frozenset({kernel_id})))[kernel_id]
        if isinstance(result, BaseException):
            raise result
        return result

    async def read(self, kernel_ids: frozenset[str | None]) -> Reading:
        """One reading for each of ``kernel_ids``, at the cost of one: the agent is asked once
        for the node's GPUs and once per distinct target for its attachments, NVML is read
        once. A failure belongs to the kernels it concerns (an unknown kernel, a target the
        agent refuses); a failure to read the node or NVML concerns them all."""
        self._check_open()
        whom: dict[str | None, Target | BaseException | None] = {}
        for kernel_id in kernel_ids:
            try:
                whom[kernel_id] = self.targets.of(
                    None if kernel_id is None else KernelId(kernel_id)
                )
            except HotplugError as error:
                whom[kernel_id] = error
        asked = {target.ref for target in whom.values() if isinstance(target, Target)}
        # Every read runs concurrently; each outcome is used below, or settled.
        node = asyncio.ensure_future(self.client.gpus())
        snapshot = asyncio.ensure_future(self._snapshot())
        # The attachments' answer carries the target's suspension too: one request a target.
        attached = {
            target: asyncio.ensure_future(self.client.attachment_state(target)) for target in asked
        }
        attribution: list[GpuAttributionJson] = []
        try:
            await asyncio.wait([node, snapshot, *attached.values()])
            paths = await self._notebook_paths()
            kernels = self._kernel_holders(paths)
            if snapshot.exception() is None:
                self._history.record(snapshot.result())
                attribution = await self._attribution(snapshot.result(), paths)
            await self._note_releases(whom, attached)
            await self._read_agent_queue(whom, node, attached)
        finally:
            await _settle(node, snapshot, *attached.values())
        reading: dict[str | None, GpusJson | BaseException] = {}
        for kernel_id, target in whom.items():
            reading[kernel_id] = self._view(
                kernel_id, target, node, snapshot, attached, kernels, attribution
            )
        return reading

    def history(self) -> HistoryJson:
        """The node's GPU readings of the last hour, as this server took them."""
        self._check_open()
        return self._history.json()

    async def _read_agent_queue(
        self,
        whom: Mapping[str | None, Target | BaseException | None],
        node: asyncio.Future[tuple[Gpu, ...]],
        attached: Mapping[PidRef | None, asyncio.Future[AttachmentState]],
    ) -> None:
        """Learn the watched kernels' waits in the agent's queue (where the strategy
        ``reports_queue_place``: sandboxed kernels), so that a wait the magic or the command
        line started shows in the panel, the toolbar and the status bar like one started here.
        Asked at every reading while the kernel is seen waiting, every
        ``AGENT_QUEUE_EVERY_NONE_FREE``-th while no GPU is free (a wait is likely), and
        otherwise every ``AGENT_QUEUE_EVERY``-th (a wait for more GPUs than are free), so the
        stream's cost on the agent grows little (``bench_stream.py``); never for a
        target whose attachments the agent just refused (it would refuse this too)."""
        if not self.targets.reports_queue_place:
            return
        self._queue_polls += 1
        no_free = node.exception() is None and plain_free(node.result()) == 0
        asked: dict[str | None, Target] = {}
        for kernel_id, target in whom.items():
            if not isinstance(target, Target) or target.ref is None:
                continue
            if attached[target.ref].exception() is not None:
                continue
            every = AGENT_QUEUE_EVERY_NONE_FREE if no_free else AGENT_QUEUE_EVERY
            seen_waiting = bool(self._agent_waits.get(kernel_id, (0.0, ()))[1])
            if seen_waiting or self._queue_polls % every == 1 % every:
                asked[kernel_id] = target
        if not asked:
            return
        answers = await asyncio.gather(
            *(self.client.queued(target.ref) for target in asked.values()),
            return_exceptions=True,
        )
        for (kernel_id, _target), answer in zip(asked.items(), answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, AgentClientError):
                    raise answer
                self._log.debug("cannot read the queue of kernel %s: %r", kernel_id, answer)
                continue
            self._agent_waits[kernel_id] = (
                time.monotonic(),
                tuple(
                    WaitingAttach(
                        request_id=queued.request_id,
                        kernel_id=kernel_id,
                        count=queued.count,
                        deadline=None,
                        position=queued.position,
                        of=queued.length,
                    )
                    for queued in answer
                ),
            )

    def _queue(self) -> list[WaitingAttach]:
        """This server's waiting attaches, then the watched kernels' other waits."""
        queue = list(self._waiting.values())
        mine = {waiting.request_id for waiting in queue}
        # A kernel nobody watches any more is not read again: its last answer expires.
        since = time.monotonic() - 2 * AGENT_QUEUE_EVERY * self.interval
        for kernel_id, (read_at, waits) in list(self._agent_waits.items()):
            if read_at < since:
                del self._agent_waits[kernel_id]
                continue
            queue += [waiting for waiting in waits if waiting.request_id not in mine]
        return queue

    async def _note_releases(
        self,
        whom: Mapping[str | None, Target | BaseException | None],
        attached: Mapping[PidRef | None, asyncio.Future[AttachmentState]],
    ) -> None:
        """Compare each kernel's attachments with its last reading's; for GPUs gone, find
        out why (one agent call, for the idle policy's releases, only when one is gone)."""
        for kernel_id, target in whom.items():
            if not isinstance(target, Target):
                continue
            own = attached[target.ref]
            if own.exception() is not None:
                continue
            lost = self._releases.lost(kernel_id, target.ref, own.result().attachments)
            if lost is None:
                continue
            before, gone = lost
            idle: set[str] = set()
            if before == target.ref:
                try:
                    idle = {r.uuid for r in await self.client.idle_releases(before)}
                except AgentClientError as error:
                    self._log.debug("cannot read the idle releases: %r", error)
            self._releases.explain(
                kernel_id, target=target.ref, before=before, gone=gone, idle=idle
            )

    def _view(
        self,
        kernel_id: str | None,
        target: Target | BaseException | None,
        node: asyncio.Future[tuple[Gpu, ...]],
        snapshot: asyncio.Future[Snapshot],
        attached: Mapping[PidRef | None, asyncio.Future[AttachmentState]],
        kernels: Mapping[int, KernelHolder],
        attribution: list[GpuAttributionJson],
    ) -> GpusJson | BaseException:
        """One kernel's part of a reading; its failure, first the kernel's own, if any."""
        if isinstance(target, BaseException):
            return target
        own = None if target is None else attached[target.ref]
        for future in (own, node, snapshot):
            if future is not None and future.exception() is not None:
                return cast(BaseException, future.exception())
        state = None if own is None else own.result()
        return gpus_json(
            mode=self.mode,
            kernel_id=kernel_id,
            attachments=() if state is None else state.attachments,
            node=node.result(),
            snapshot=snapshot.result(),
            max_count=self.max_count,
            kernels=kernels,
            queue=self._queue(),
            released=self._releases.recent(kernel_id),
            attribution=attribution,
            suspended=None if state is None else state.suspended,
        )

    # --- attach and detach ---------------------------------------------------------------------

    async def attach(self, request: AttachRequest) -> AttachJson:
        """Attach ``request.count`` GPUs, publishing progress while the agent works."""
        self._check_open()
        target = self.targets.required(request.kernel_id, "attach a GPU")
        request_id = request.request_id or RequestId(uuid.uuid4().hex)
        progress = _Progress(
            self._hub,
            request_id=request_id,
            kernel_id=request.kernel_id,
            count=request.count,
            scope=target.scope,
        )
        progress.publish("started")
        call = asyncio.create_task(
            self.client.attach(
                request.count,
                target=target.ref,
                wait_seconds=request.wait_seconds,
                request_id=request_id,
                gpus=request.gpus,
                model=None if request.selector is None else request.selector.model,
                min_memory=None if request.selector is None else request.selector.min_memory,
            )
        )
        self._calls.add(call)
        if request.wait_seconds is not None:
            self._waiting[request_id] = WaitingAttach(
                request_id=request_id,
                kernel_id=request.kernel_id,
                count=request.count,
                deadline=time.time() + request.wait_seconds,
            )
        try:
            while not (await asyncio.wait({call}, timeout=self.interval))[0]:
                place = await self._queue_place(request, target, request_id)
                waiting = self._waiting.get(request_id)
                if waiting is not None and place:
                    self._waiting[request_id] = dataclasses.replace(
                        waiting, position=place["position"], of=place["of"]
                    )
                progress.publish("waiting", **place)
            if call.cancelled():
                raise ShuttingDown()
            attachments = call.result()
        except BaseException as error:
            reply = error_reply(error) or internal_error_reply()
            progress.publish("failed", error={**reply.body, "status": reply.status})
            raise
        finally:
            self._calls.discard(call)
            self._waiting.pop(request_id, None)
            if not call.done():
                call.cancel()
        wire = [attachment_json(attachment) for attachment in attachments]
        progress.publish("attached", attachments=wire)
        self._log.info(
            "attached %s to %s",
            ", ".join(f"{a.uuid} ({a.device})" for a in attachments),
            target.label,
        )
        return AttachJson(request_id=request_id, kernel_id=request.kernel_id, attachments=wire)

    async def _queue_place(
        self, request: AttachRequest, target: Target, request_id: RequestId
    ) -> dict[str, int]:
        """``{position, of}`` while the attach waits in the agent's queue (with
        ``wait_seconds``, where the strategy reports queue places), else ``{}``. One agent
        call per interval of a waiting attach, however many streams watch it; a failure only
        leaves the place out of the event."""
        if not self.targets.reports_queue_place or request.wait_seconds is None:
            return {}
        try:
            waiting = await self.client.queued(target.ref)
        except AgentClientError as error:
            self._log.debug("cannot read the queue place of %s: %r", request_id, error)
            return {}
        for queued in waiting:
            if queued.request_id == request_id:
                return {"position": queued.position, "of": queued.length}
        return {}

    async def cancel(self, request: CancelRequest) -> None:
        """Take the target's waiting attach ``request.request_id`` out of the agent's queue;
        its ``POST attach`` then fails (``insufficient_gpus``, saying it was cancelled)."""
        self._check_open()
        target = self.targets.required(request.kernel_id, "cancel a waiting attach")
        waiting = await self.client.queued(target.ref)
        if request.request_id not in {queued.request_id for queued in waiting}:
            raise RequestNotWaiting(request.request_id, kernel_id=request.kernel_id)
        # Scoped to the target: another container's request with the same id stays.
        await self.client.cancel_queued(request.request_id, target.ref)
        self._log.info("cancelled the waiting attach %s of %s", request.request_id, target.label)

    async def detach(self, request: DetachRequest) -> None:
        """Detach one GPU of the target, or all of them (with ``keep``, the agent suspends
        the target's CUDA processes first and resumes them at its next attach)."""
        self._check_open()
        target = self.targets.required(request.kernel_id, "detach a GPU")
        if request.uuid is None:
            # What the last reading saw (no extra agent request): a GPU attached since
            # then and taken by this detach is announced as "detached elsewhere".
            mine = self._releases.held(request.kernel_id)
            self._releases.detached_here(mine)
            try:
                await self.client.detach_all(
                    target=target.ref, force=request.force, keep=request.keep
                )
            except BaseException:
                self._releases.not_detached_here(mine)
                raise
        else:
            if target.ref is not None and request.kernel_id is not None:
                # The server may act on any process through the agent's token: make sure the
                # GPU is this kernel's before taking it away.
                attached = await self.client.attachments(target.ref)
                if request.uuid not in {attachment.uuid for attachment in attached}:
                    raise GpuNotAttached(request.uuid, kernel_id=request.kernel_id)
            self._releases.detached_here([request.uuid])
            try:
                await self.client.detach(request.uuid, force=request.force)
            except BaseException:
                self._releases.not_detached_here([request.uuid])
                raise
        self._log.info(
            "detached %s from %s%s",
            "all GPUs" if request.uuid is None else request.uuid,
            target.label,
            " (forced)" if request.force else " (CUDA state kept)" if request.keep else "",
        )

    # --- streams -------------------------------------------------------------------------------

    def subscribe(self, kernel_id: KernelId | None) -> Subscription:
        """Open a stream for ``kernel_id`` (checked now: an unknown kernel fails here, before
        the stream starts). The caller must ``unsubscribe`` it when done."""
        self._check_open()
        target = self.targets.of(kernel_id)
        subscription = Subscription(key=kernel_id, scope=None if target is None else target.scope)
        self._hub.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._hub.remove(subscription)

    # --- life ----------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop: end every stream, abandon attaches in flight, release NVML. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for call in self._calls:
            call.cancel()
        await self._hub.close(timeout=STREAM_CLOSE_TIMEOUT)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._nvml, self._monitor.close)
        self._nvml.shutdown(wait=True)
