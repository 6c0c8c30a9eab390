"""What can go wrong in the server extension, and the one mapping of every failure to HTTP.

Boundary: exception classes of the extension's own checks (bad input, unknown kernel, a kernel
that is not sandboxed) and ``error_reply``, which turns them *and* the agent client's errors
into a status and a JSON body. No I/O, no tornado.

Why one mapping: the REST handlers (``write_error``) and the live stream (a ``failed``
progress event) must describe a failure identically, so the toolbar shows the same words
whether it learnt of a failure from the POST or from the stream. Errors the agent reported
keep the agent's status, code and message (DESIGN §3); failures to reach the agent get
statuses of their own (503 when no agent answers, 502/504 when an answer was lost). Managers
raise these classes, never tornado's ``HTTPError`` (STYLE 7).

Every body has ``error`` (a code from one vocabulary shared with the agent), ``message``
(written for the person at the notebook), ``reason`` (the HTTP reason phrase, as
jupyter_server's own JSON errors have) and ``retryable``, plus the code's extra members
(``free`` and ``requested`` for ``insufficient_gpus``, ``processes`` for ``busy``...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import ClassVar, Final

from .._structs import STATUS_BY_CODE
from ..client import (
    AgentClientError,
    AgentConnectionLost,
    AgentError,
    AgentProtocolError,
    AgentUnavailable,
    ClientConfigError,
)

__all__ = [
    "AgentNotAnswering",
    "BodyTooLarge",
    "ErrorReply",
    "GpuNotAttached",
    "HotplugError",
    "InvalidInput",
    "KernelIdRequired",
    "KernelNotFound",
    "KernelNotRunning",
    "KernelNotSandboxed",
    "RequestNotWaiting",
    "ShuttingDown",
    "error_reply",
    "internal_error_reply",
]


class HotplugError(Exception):
    """Base of the server extension's own errors; ``code`` decides the HTTP status.

    ``message`` is for the person at the notebook; ``extra`` holds the code's additional
    members of the JSON body.
    """

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int | None] = None
    """The HTTP status when it is not the code's usual one."""
    default_retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        retryable: bool | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = self.default_retryable if retryable is None else retryable
        self.extra: Mapping[str, object] = dict(extra or {})


class InvalidInput(HotplugError):
    """The request itself is malformed; ``field`` names the offending input."""

    code = "invalid_request"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message, extra={"field": field})
        self.field = field


class BodyTooLarge(InvalidInput):
    """413: the body is over the limit (refused before it is read, as the agent does)."""

    status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the request body is larger than {limit} bytes; no request of this API needs more",
            field="body",
        )


class KernelIdRequired(InvalidInput):
    """Local mode acts on one kernel's sandbox, so an operation must name the kernel."""

    def __init__(self, operation: str) -> None:
        super().__init__(
            f"to {operation}, name the kernel: in local mode every kernel runs in a sandbox "
            "of its own and GPUs are attached to one kernel at a time (send its kernel_id)",
            field="kernel_id",
        )


class KernelNotFound(HotplugError):
    """No kernel with this id runs in this server."""

    code = "not_found"

    def __init__(self, kernel_id: str) -> None:
        super().__init__(
            f"no kernel {kernel_id} runs in this Jupyter server; it may have been shut down",
            extra={"resource": "kernel", "name": kernel_id},
        )


class KernelNotSandboxed(HotplugError):
    """The kernel runs, but not in a sandbox, so there is nothing a GPU could be attached to."""

    code = "target_not_ready"

    def __init__(self, kernel_id: str) -> None:
        super().__init__(
            f"kernel {kernel_id} does not run in a GPU sandbox, so no GPU can be attached to "
            "it alone; start the notebook with a sandboxed kernel (the 'Python 3 (GPU sandbox)' "
            "kernel, or any kernel of `jupyter gpu-hotplug demo`)",
        )


class KernelNotRunning(HotplugError):
    """The kernel exists but has no process right now (starting, restarting, shutting down)."""

    code = "target_not_ready"
    default_retryable = True

    def __init__(self, kernel_id: str) -> None:
        super().__init__(
            f"kernel {kernel_id} has no running process right now (it is starting, "
            "restarting or stopping); try again in a moment",
        )


class GpuNotAttached(HotplugError):
    """Detach named a GPU that the kernel does not have."""

    code = "not_found"

    def __init__(self, uuid: str, *, kernel_id: str) -> None:
        super().__init__(
            f"GPU {uuid} is not attached to kernel {kernel_id}",
            extra={"resource": "attachment", "name": uuid},
        )


class RequestNotWaiting(HotplugError):
    """Cancel named a request that is not waiting for this kernel (served, failed, another
    kernel's, or never made)."""

    code = "not_found"

    def __init__(self, request_id: str, *, kernel_id: str | None) -> None:
        whose = "this pod" if kernel_id is None else f"kernel {kernel_id}"
        super().__init__(
            f"no attach request {request_id} is waiting for a GPU for {whose}",
            extra={"resource": "queued_request", "name": request_id},
        )


class AgentNotAnswering(HotplugError):
    """The live stream's reading has waited ``seconds`` for the agent, and waits on.

    Why: a stopped or hung agent keeps its socket, so a connection succeeds and only the
    client's read timeout (times its retries: about 90 s) would end the read. Until then the
    views kept the last readings as if live; this error tells them at once that the agent
    is silent (504, as a lost answer), while the reading goes on."""

    code = "agent_timeout"
    status = 504

    def __init__(self, *, seconds: float) -> None:
        super().__init__(
            f"The GPU agent has not answered for {seconds:.0f} s: the GPU readings shown are "
            "out of date. They come back when it answers; if this lasts, ask your platform "
            "administrator to look at the agent.",
            retryable=True,
        )
        self.seconds = seconds


class ShuttingDown(HotplugError):
    """The Jupyter server is stopping; the operation was abandoned."""

    code = "shutting_down"

    def __init__(self) -> None:
        super().__init__("the Jupyter server is shutting down")


@dataclass(frozen=True)
class ErrorReply:
    """An HTTP status and the JSON body that describe one failure."""

    status: int
    body: Mapping[str, object]


_STATUS_BY_CODE: Final[Mapping[str, int]] = {
    **{str(code): status for code, status in STATUS_BY_CODE.items()},
    "shutting_down": 503,
}

_ENVELOPE: Final = ("error", "message", "reason", "retryable")


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # a status HTTP does not name (an agent's own 5xx, say)
        return ""


def _reply(
    status: int,
    code: str,
    message: str,
    *,
    retryable: bool,
    extra: Mapping[str, object] | None = None,
) -> ErrorReply:
    # The envelope wins over same-named extra members, whatever an agent sends.
    body: dict[str, object] = {k: v for k, v in (extra or {}).items() if k not in _ENVELOPE}
    body.update(
        error=code,
        message=message,
        reason=_phrase(status),
        retryable=retryable,
    )
    return ErrorReply(status, body)


def _client_reply(error: AgentClientError) -> ErrorReply:
    if isinstance(error, AgentError):
        # The agent's own word: same status, code and message (DESIGN §3).
        return _reply(
            error.status,
            error.code or "agent_error",
            error.message,
            retryable=error.retryable,
            extra=error.extra,
        )
    if isinstance(error, AgentUnavailable):
        return _reply(503, "agent_unavailable", error.message, retryable=True)
    if isinstance(error, AgentConnectionLost):
        if error.timed_out:
            return _reply(504, "agent_timeout", error.message, retryable=True)
        return _reply(502, "agent_connection_lost", error.message, retryable=True)
    if isinstance(error, AgentProtocolError):
        return _reply(502, "agent_protocol_error", error.message, retryable=False)
    if isinstance(error, ClientConfigError):
        return _reply(
            500,
            "server_misconfigured",
            f"the GPU hot-plug extension is configured wrongly: {error.message}",
            retryable=False,
        )
    return _reply(502, "agent_error", error.message, retryable=error.retryable)


def error_reply(error: BaseException) -> ErrorReply | None:
    """The answer describing ``error``; ``None`` when it is neither ours nor the agent client's
    (a bug, or tornado's own ``HTTPError``), which the caller answers in its usual way."""
    if isinstance(error, HotplugError):
        status = error.status or _STATUS_BY_CODE.get(error.code, 500)
        return _reply(
            status, error.code, error.message, retryable=error.retryable, extra=error.extra
        )
    if isinstance(error, AgentClientError):
        return _client_reply(error)
    return None


def internal_error_reply() -> ErrorReply:
    """The answer for a failure that is a bug: no details leave the server (they are logged)."""
    return _reply(
        500,
        "internal_error",
        "the GPU hot-plug extension failed unexpectedly; the Jupyter server's log has the details",
        retryable=False,
    )
