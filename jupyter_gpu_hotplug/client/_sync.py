"""``AgentClient``: the blocking client, for the ``%gpu`` magic and the command line.

Boundary: the blocking transport (one socket per attempt: TCP, TLS or a unix socket) and the
retry loop's sleep. Requests, answers, retries and errors are ``_core``'s.
"""

from __future__ import annotations

import socket
import ssl
import time
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

__all__ = ["AgentClient"]

_CHUNK = 65536
_T = TypeVar("_T")


def _connect(
    endpoint: AgentEndpoint, *, timeout: float, ssl_context: ssl.SSLContext | None
) -> socket.socket:
    """A connected socket (TLS done for https); ``TransportFailure(CONNECT)`` otherwise."""
    sock: socket.socket | None = None
    try:
        if endpoint.socket_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(endpoint.socket_path)
        else:
            sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
        if ssl_context is not None and endpoint.scheme == "https":
            sock = ssl_context.wrap_socket(sock, server_hostname=endpoint.host)
    except OSError as error:
        if sock is not None:
            sock.close()
        raise failure_from_os_error(Stage.CONNECT, error, timeout=timeout) from error
    return sock


def _exchange(
    endpoint: AgentEndpoint,
    payload: bytes,
    *,
    connect_timeout: float,
    read_timeout: float,
    ssl_context: ssl.SSLContext | None,
) -> bytes:
    """Send ``payload``, return the answer's bytes (complete, or cut short by the agent).

    ``read_timeout`` bounds the whole exchange after connecting, not each ``recv``.
    """
    with _connect(endpoint, timeout=connect_timeout, ssl_context=ssl_context) as sock:
        deadline = time.monotonic() + read_timeout
        reader = ResponseReader()
        try:
            sock.settimeout(read_timeout)
            sock.sendall(payload)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                sock.settimeout(remaining)
                chunk = sock.recv(_CHUNK)
                if not chunk or reader.feed(chunk):
                    break
        except OSError as error:
            raise failure_from_os_error(Stage.EXCHANGE, error, timeout=read_timeout) from error
        return reader.data


class AgentClient(BaseAgentClient):
    """Talks to the node agent, blocking. Every method raises only ``AgentClientError``s.

    Holds no connection between calls, so it needs no closing and may be shared by threads.
    """

    def gpus(self) -> tuple[Gpu, ...]:
        """Every GPU of the node and who has it (``GET /v1/gpus``)."""
        return self._call(list_gpus_call())

    def attachments(self, target: AnyTarget | None = None) -> tuple[Attachment, ...]:
        """The GPUs hot-attached to ``target`` (default: the caller itself)."""
        return self._call(list_attachments_call(target))

    def attachment_state(self, target: AnyTarget | None = None) -> AttachmentState:
        """``target``'s GPUs and, while its CUDA state is kept without them (a
        ``detach_all(keep=True)``), that suspension; one request, as ``attachments``."""
        return self._call(attachment_state_call(target))

    def attach(
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
        return self._call(
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

    def detach(self, uuid: GpuUuid | str, *, force: bool = False) -> None:
        """Detach one GPU; ``force`` kills the target's processes that hold it open."""
        self._call(detach_call(uuid, force=force))

    def detach_all(
        self, *, target: AnyTarget | None = None, force: bool = False, keep: bool = False
    ) -> None:
        """Detach every GPU hot-attached to ``target`` (default: the caller itself). ``keep``
        suspends its CUDA processes into host memory first, so its next ``attach`` resumes
        them (``attachment_state`` shows the suspension); never with ``force``
        (``InvalidRequest``, nothing sent)."""
        self._call(detach_all_call(target=target, force=force, keep=keep))

    def queued(self, target: AnyTarget | None = None) -> tuple[QueuedRequest, ...]:
        """``target``'s attach requests waiting for GPUs, with their positions (local mode)."""
        return self._call(list_queued_call(target))

    def cancel_queued(self, request_id: str, target: AnyTarget | None = None) -> None:
        """Cancel ``target``'s waiting attach request (its attach then fails with
        ``InsufficientGpus``); without a target, the calling container's."""
        self._call(cancel_queued_call(request_id, target))

    def idle_releases(self, target: AnyTarget | None = None) -> tuple[IdleRelease, ...]:
        """The GPUs the agent's idle policy took back from ``target`` lately, oldest first."""
        return self._call(list_idle_releases_call(target))

    def health(self) -> Health:
        """Whether the agent process is alive (``GET /healthz``; no token sent)."""
        return self._call(health_call())

    def _call(self, call: ApiCall[_T]) -> _T:
        core = self._core
        attempt = 1
        while True:
            prepared = core.prepare(call)
            try:
                data = _exchange(
                    core.endpoint,
                    prepared.payload,
                    connect_timeout=core.timeouts.connect,
                    read_timeout=prepared.read_timeout,
                    ssl_context=core.ssl_context,
                )
                return core.conclude(call, prepared, data)
            except TransportFailure as failure:
                time.sleep(core.after_failure(call, failure, attempt=attempt))
            attempt += 1
