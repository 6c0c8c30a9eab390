"""``AsyncAgentClient``: the non-blocking client, for the server extension and the widget.

Boundary: the asyncio transport (one stream per attempt: TCP, TLS or a unix socket) and the
retry loop's sleep. Requests, answers, retries and errors are ``_core``'s.

Why asyncio streams rather than tornado's ``AsyncHTTPClient`` or a thread running the blocking
client: tornado's client cannot reach a unix socket without replacing its resolver and still
leaves connect-time and answer-time failures hard to tell apart (which decides whether a retry
is safe), and a thread per call cannot be cancelled. Streams run on whichever asyncio loop
calls them (jupyter_server's tornado loop is one; so is ipykernel's), connect to TCP and unix
sockets alike, and cancelling the calling task closes the connection at once.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import TypeVar

from .._structs import GpuUuid
from ._core import AnyTarget, ApiCall, BaseAgentClient
from ._core import attach as attach_call
from ._core import attachment_state as attachment_state_call
from ._core import cancel_queued as cancel_queued_call
from ._core import detach as detach_call
from ._core import detach_all as detach_all_call
from ._core import health as health_call
from ._core import list_attachments as list_attachments_call
from ._core import list_gpus as list_gpus_call
from ._core import list_idle_releases as list_idle_releases_call
from ._core import list_queued as list_queued_call
from ._http import AgentEndpoint, ResponseReader, Stage, TransportFailure, failure_from_os_error
from .models import Attachment, AttachmentState, Gpu, Health, IdleRelease, QueuedRequest

__all__ = ["AsyncAgentClient"]

_CHUNK = 65536
_T = TypeVar("_T")


async def _open(
    endpoint: AgentEndpoint, *, timeout: float, ssl_context: ssl.SSLContext | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connected streams (TLS done for https); ``TransportFailure(CONNECT)`` otherwise."""
    try:
        async with asyncio.timeout(timeout):
            if endpoint.socket_path is not None:
                return await asyncio.open_unix_connection(endpoint.socket_path)
            tls = ssl_context if endpoint.scheme == "https" else None
            return await asyncio.open_connection(
                endpoint.host,
                endpoint.port,
                ssl=tls,
                server_hostname=endpoint.host if tls is not None else None,
            )
    except OSError as error:  # TimeoutError included
        raise failure_from_os_error(Stage.CONNECT, error, timeout=timeout) from error


async def _exchange(
    endpoint: AgentEndpoint,
    payload: bytes,
    *,
    connect_timeout: float,
    read_timeout: float,
    ssl_context: ssl.SSLContext | None,
) -> bytes:
    """Send ``payload``, return the answer's bytes (complete, or cut short by the agent)."""
    reader, writer = await _open(endpoint, timeout=connect_timeout, ssl_context=ssl_context)
    response = ResponseReader()
    try:
        async with asyncio.timeout(read_timeout):
            writer.write(payload)
            await writer.drain()
            while True:
                chunk = await reader.read(_CHUNK)
                if not chunk or response.feed(chunk):
                    break
    except OSError as error:  # TimeoutError included
        raise failure_from_os_error(Stage.EXCHANGE, error, timeout=read_timeout) from error
    finally:
        # Nothing is left to send, so drop the connection at once: a graceful close would
        # wait for the agent's TLS close_notify, which a stuck agent never sends.
        writer.transport.abort()
    return response.data


class AsyncAgentClient(BaseAgentClient):
    """Talks to the node agent without blocking the event loop; raises only
    ``AgentClientError``s.

    Holds no connection between calls, so it needs no closing and works on any event loop.
    """

    async def gpus(self) -> tuple[Gpu, ...]:
        """Every GPU of the node and who has it (``GET /v1/gpus``)."""
        return await self._call(list_gpus_call())

    async def attachments(self, target: AnyTarget | None = None) -> tuple[Attachment, ...]:
        """The GPUs hot-attached to ``target`` (default: the caller itself)."""
        return await self._call(list_attachments_call(target))

    async def attachment_state(self, target: AnyTarget | None = None) -> AttachmentState:
        """``target``'s GPUs and, while its CUDA state is kept without them (a
        ``detach_all(keep=True)``), that suspension; one request, as ``attachments``."""
        return await self._call(attachment_state_call(target))

    async def attach(
        self,
        count: int = 1,
        *,
        target: AnyTarget | None = None,
        wait_seconds: float | None = None,
        request_id: str | None = None,
        mig: str | None = None,
        idle_release_seconds: float | None = None,
        gpus: Sequence[GpuUuid | str] = (),
        model: str | None = None,
        min_memory: int | str | None = None,
    ) -> tuple[Attachment, ...]:
        """Attach ``count`` GPUs; waits up to ``wait_seconds`` (agent default 60) for them.

        ``request_id`` (default: a new one per call) makes repeats idempotent, so the client
        may retry a lost answer without attaching twice. ``mig`` (e.g. ``"1g.10gb"``)
        attaches MIG slices of that profile instead of whole GPUs; ``idle_release_seconds``
        asks the agent to release them after that long unused (never later than its policy).
        ``gpus`` names the GPUs (UUIDs, ``count`` of them) to attach instead of any free ones;
        the agent refuses it where the cluster picks the device (``Gpu.selectable``).
        ``model`` (part of the product name, ``"H100"``) and ``min_memory`` (bytes, or
        ``"80G"`` decimal, ``"40Gi"`` binary) ask for GPUs by attribute instead.
        """
        return await self._call(
            attach_call(
                count,
                target=target,
                wait_seconds=wait_seconds,
                request_id=request_id,
                mig=mig,
                idle_release_seconds=idle_release_seconds,
                gpus=[GpuUuid(uuid) for uuid in gpus],
                model=model,
                min_memory=min_memory,
            )
        )

    async def detach(self, uuid: GpuUuid | str, *, force: bool = False) -> None:
        """Detach one GPU; ``force`` kills the target's processes that hold it open."""
        await self._call(detach_call(uuid, force=force))

    async def detach_all(
        self, *, target: AnyTarget | None = None, force: bool = False, keep: bool = False
    ) -> None:
        """Detach every GPU hot-attached to ``target`` (default: the caller itself). ``keep``
        suspends its CUDA processes into host memory first, so its next ``attach`` resumes
        them (``attachment_state`` shows the suspension); never with ``force``
        (``InvalidRequest``, nothing sent)."""
        await self._call(detach_all_call(target=target, force=force, keep=keep))

    async def queued(self, target: AnyTarget | None = None) -> tuple[QueuedRequest, ...]:
        """``target``'s attach requests waiting for GPUs, with their positions (local mode)."""
        return await self._call(list_queued_call(target))

    async def cancel_queued(self, request_id: str, target: AnyTarget | None = None) -> None:
        """Cancel ``target``'s waiting attach request (its attach then fails with
        ``InsufficientGpus``); without a target, the calling container's."""
        await self._call(cancel_queued_call(request_id, target))

    async def idle_releases(self, target: AnyTarget | None = None) -> tuple[IdleRelease, ...]:
        """The GPUs the agent's idle policy took back from ``target`` lately, oldest first."""
        return await self._call(list_idle_releases_call(target))

    async def health(self) -> Health:
        """Whether the agent process is alive (``GET /healthz``; no token sent)."""
        return await self._call(health_call())

    async def _call(self, call: ApiCall[_T]) -> _T:
        core = self._core
        attempt = 1
        while True:
            prepared = core.prepare(call)
            try:
                data = await _exchange(
                    core.endpoint,
                    prepared.payload,
                    connect_timeout=core.timeouts.connect,
                    read_timeout=prepared.read_timeout,
                    ssl_context=core.ssl_context,
                )
                return core.conclude(call, prepared, data)
            except TransportFailure as failure:
                await asyncio.sleep(core.after_failure(call, failure, attempt=attempt))
            attempt += 1
