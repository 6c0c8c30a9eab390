"""Everything that can go wrong between the notebook side and the node agent, as one hierarchy.

Boundary: exception classes and the pure mapping from an HTTP error response to one of them.
Nothing here does I/O.

Why it exists: every frontend (REST handlers, ``%gpu``, the widget, the CLI) catches
``AgentClientError`` and shows ``message`` to a person, so each failure arrives as one of a few
classes that say what happened and what to do, never as a socket or JSON traceback. The API's
error codes (DESIGN §3) are mirrored here one class per code, *without importing the agent
package*: the notebook side never imports the agent, and a test checks that the two lists agree.

``retryable`` sorts errors as the agent does: whether the *same* call, made again later, may
succeed (``insufficient_gpus``: GPUs may be released meanwhile) or whether something has to
change first (``invalid_request``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Final

from .._structs import ERROR_ENVELOPE, STATUS_BY_CODE, ErrorCode, GpuUuid

__all__ = [
    "ERRORS_BY_CODE",
    "AgentClientError",
    "AgentConnectionLost",
    "AgentError",
    "AgentInternalError",
    "AgentProtocolError",
    "AgentTimeout",
    "AgentUnavailable",
    "Busy",
    "BusyProcess",
    "ClientConfigError",
    "Forbidden",
    "InsufficientGpus",
    "InvalidRequest",
    "NotFound",
    "TargetNotReady",
    "Unauthenticated",
    "error_from_response",
]

_SNIPPET_CHARS: Final = 200


class AgentClientError(Exception):
    """Base of everything the agent client raises.

    ``message`` is written for the person at the notebook; ``retryable`` says whether the same
    call, made again later, may succeed.
    """

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable


class ClientConfigError(AgentClientError, ValueError):
    """The client is set up wrongly (a malformed agent URL, an unreadable token file).

    Also a ``ValueError``: it is raised for bad configuration values, before anything is sent.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class AgentUnavailable(AgentClientError):
    """No connection to the agent could be made, so nothing was sent to it.

    Typical causes: no agent runs on this node (GPU hot-plug is not enabled here), the agent is
    restarting, or the URL is wrong.
    """

    def __init__(self, *, agent_url: str, reason: str) -> None:
        super().__init__(
            f"No GPU agent on this node: could not connect to {agent_url} ({reason}). "
            "Ask your platform administrator whether GPU hot-plug is enabled here.",
            retryable=True,
        )
        self.agent_url = agent_url
        self.reason = reason


class AgentConnectionLost(AgentClientError):
    """The agent was reached but no complete answer came back.

    The request may or may not have taken effect, so the message says to look before trying
    again. ``timed_out``: no answer within the read timeout (rather than a dropped connection).
    """

    def __init__(
        self, *, agent_url: str, operation: str, reason: str, timed_out: bool, attempts: int
    ) -> None:
        tries = "" if attempts == 1 else f" (tried {attempts} times)"
        super().__init__(
            f"The GPU agent at {agent_url} did not answer the request to {operation}: "
            f"{reason}{tries}. It may still have done it: check the current GPUs before trying "
            "again, and if this keeps happening, ask your platform administrator to look at the "
            "agent's log.",
            retryable=True,
        )
        self.agent_url = agent_url
        self.operation = operation
        self.reason = reason
        self.timed_out = timed_out
        self.attempts = attempts


class AgentProtocolError(AgentClientError):
    """The answer does not follow the agent API (DESIGN §3): not the agent, or another version."""

    def __init__(self, *, agent_url: str, operation: str, detail: str) -> None:
        super().__init__(
            f"Unexpected answer from the GPU agent at {agent_url} to the request to "
            f"{operation}: {detail}. Check that this URL is the GPU agent and that the agent and "
            "the notebook side are compatible versions.",
            retryable=False,
        )
        self.agent_url = agent_url
        self.operation = operation
        self.detail = detail


@dataclass(frozen=True)
class BusyProcess:
    """A process that keeps a GPU busy, as a ``busy`` error lists it."""

    pid: int
    command: str


def _int_or_none(extra: Mapping[str, object], key: str) -> int | None:
    value = extra.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_or_none(extra: Mapping[str, object], key: str) -> str | None:
    value = extra.get(key)
    return value if isinstance(value, str) else None


_REGISTRY: dict[ErrorCode, type[AgentError]] = {}


class AgentError(AgentClientError):
    """The agent answered with an API error: ``{"error": code, "message", "retryable", ...}``.

    ``status`` and ``code`` are what the agent sent (an unknown ``code`` is kept as sent, and
    the class is then chosen by ``status``; without the API's JSON, ``code`` is that class's
    code, or empty for a status no class stands for); ``extra`` holds the code's additional members,
    which subclasses also offer as typed attributes (``None`` when the agent left one out).
    """

    CODE: ClassVar[ErrorCode | None] = None
    """The API error code this class stands for; ``None`` for this base (unmapped statuses)."""
    STATUS: ClassVar[int | None] = None
    """The status that code comes with (``_structs.STATUS_BY_CODE``)."""
    DEFAULT_RETRYABLE: ClassVar[bool] = False
    """Used when the answer does not say (a body that is not the API's JSON)."""

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        if cls.CODE is not None:
            cls.STATUS = STATUS_BY_CODE[cls.CODE]
            _REGISTRY[cls.CODE] = cls

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: str,
        retryable: bool | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(
            message, retryable=self.DEFAULT_RETRYABLE if retryable is None else retryable
        )
        self.status = status
        self.code = code
        self.extra: Mapping[str, object] = dict(extra or {})


class InvalidRequest(AgentError):
    """400: the request is malformed; ``field`` names the offending input when known."""

    CODE = "invalid_request"

    @property
    def field(self) -> str | None:
        return _str_or_none(self.extra, "field")


class Unauthenticated(AgentError):
    """401: no token, or one the agent does not accept."""

    CODE = "unauthenticated"


class Forbidden(AgentError):
    """403: not the caller's pod, or over the pod's GPU limit (then ``limit`` etc. are set)."""

    CODE = "forbidden"

    @property
    def limit(self) -> int | None:
        return _int_or_none(self.extra, "limit")

    @property
    def attached(self) -> int | None:
        return _int_or_none(self.extra, "attached")

    @property
    def requested(self) -> int | None:
        return _int_or_none(self.extra, "requested")


class NotFound(AgentError):
    """404: no such pod, container, process or attachment on this node."""

    CODE = "not_found"

    @property
    def resource(self) -> str | None:
        return _str_or_none(self.extra, "resource")

    @property
    def name(self) -> str | None:
        return _str_or_none(self.extra, "name")


class Busy(AgentError):
    """409 ``busy``: the GPU is used by ``processes``, or another operation is in progress."""

    CODE = "busy"
    DEFAULT_RETRYABLE = True

    @property
    def processes(self) -> tuple[BusyProcess, ...]:
        listed = self.extra.get("processes")
        if not isinstance(listed, list):
            return ()
        return tuple(
            BusyProcess(pid=item["pid"], command=item["command"])
            for item in listed
            if isinstance(item, dict)
            and isinstance(item.get("pid"), int)
            and isinstance(item.get("command"), str)
        )

    @property
    def uuid(self) -> GpuUuid | None:
        text = _str_or_none(self.extra, "uuid")
        return None if text is None else GpuUuid(text)


class InsufficientGpus(AgentError):
    """409 ``insufficient_gpus``: ``requested`` GPUs asked for, only ``free`` free."""

    CODE = "insufficient_gpus"
    DEFAULT_RETRYABLE = True

    @property
    def free(self) -> int | None:
        return _int_or_none(self.extra, "free")

    @property
    def requested(self) -> int | None:
        return _int_or_none(self.extra, "requested")


class TargetNotReady(AgentError):
    """422: the target cannot take a GPU now (container not running) or ever (a VM sandbox)."""

    CODE = "target_not_ready"
    DEFAULT_RETRYABLE = True


class AgentTimeout(AgentError):
    """504 ``timeout``: the agent gave up after ``wait_seconds``; nothing was left behind.

    Not to be confused with ``AgentConnectionLost(timed_out=True)``: there the *client* stopped
    waiting for an answer.
    """

    CODE = "timeout"
    DEFAULT_RETRYABLE = True

    @property
    def wait_seconds(self) -> float | None:
        value = self.extra.get("wait_seconds")
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return None


class AgentInternalError(AgentError):
    """5xx: a bug in the agent (or a proxy's failure); ``request_id`` finds it in the log."""

    CODE = "internal_error"
    DEFAULT_RETRYABLE = True

    @property
    def request_id(self) -> str | None:
        return _str_or_none(self.extra, "request_id")


ERRORS_BY_CODE: Final[Mapping[ErrorCode, type[AgentError]]] = {
    code: _REGISTRY[code] for code in STATUS_BY_CODE
}
"""One class per code of ``_structs.ErrorCode``."""

# Where a code is unknown (a newer agent) or missing (not the API's JSON), the status decides.
# 409 has two codes; Busy, listed first, is the general "conflict" of the two.
_ERRORS_BY_STATUS: Final[Mapping[int, type[AgentError]]] = {
    STATUS_BY_CODE[code]: cls for code, cls in reversed(list(ERRORS_BY_CODE.items()))
}


_ERRORS_BY_CODE_TEXT: Final[Mapping[str, type[AgentError]]] = {
    str(code): cls for code, cls in ERRORS_BY_CODE.items()
}


def _class_for(status: int, code: str | None) -> type[AgentError]:
    if code is not None and code in _ERRORS_BY_CODE_TEXT:
        return _ERRORS_BY_CODE_TEXT[code]
    if status in _ERRORS_BY_STATUS:
        return _ERRORS_BY_STATUS[status]
    return AgentInternalError if status >= 500 else AgentError


def _snippet(body: bytes) -> str:
    text = " ".join(body.decode("utf-8", errors="replace").split())
    return text if len(text) <= _SNIPPET_CHARS else text[: _SNIPPET_CHARS - 1] + "…"


def _error_body(body: bytes) -> dict[str, object] | None:
    """The API's error JSON, or ``None`` when the body is anything else (a proxy's HTML page)."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if (
        isinstance(value, dict)
        and isinstance(value.get("error"), str)
        and isinstance(value.get("message"), str)
    ):
        return value
    return None


def error_from_response(
    status: int,
    reason: str,
    body: bytes,
    *,
    agent_url: str,
    operation: str,
    missing_token: str | None = None,
) -> AgentError:
    """The exception for an error response (status >= 400) to the request to ``operation``.

    ``missing_token``: why no token was sent, if none was; a 401 then says so, because "no
    token file" is the usual cause and the agent cannot know it.
    """
    parsed = _error_body(body)
    if parsed is None:
        code = None
        detail = f": {_snippet(body)}" if body.strip() else ""
        message = (
            f"The GPU agent at {agent_url} answered the request to {operation} with "
            f"HTTP {status} {reason}{detail}"
        )
        retryable: bool | None = None
        extra: dict[str, object] = {}
    else:
        code = str(parsed["error"])
        message = str(parsed["message"])
        sent_retryable = parsed.get("retryable")
        retryable = sent_retryable if isinstance(sent_retryable, bool) else None
        extra = {key: value for key, value in parsed.items() if key not in ERROR_ENVELOPE}
    cls = _class_for(status, code)
    if cls is Unauthenticated and missing_token is not None:
        message = f"{message} (No token was sent: {missing_token}.)"
    return cls(
        message, status=status, code=code or cls.CODE or "", retryable=retryable, extra=extra
    )
