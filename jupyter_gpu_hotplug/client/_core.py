"""The agent API as calls, shared by the sync and the async client: everything but the I/O.

Boundary: which request each API method sends, how its answer becomes a value or an
exception, when a failed attempt may be repeated, and reading the token file. ``AgentClient``
and ``AsyncAgentClient`` hold a ``ClientCore`` and add only a transport and a way to sleep.

Retries are decided here, in one place (``ClientCore.after_failure``):

- A failure *before anything was sent* (no connection) may always be retried.
- After the request may have reached the agent, only idempotent calls are retried: ``GET``s,
  and attach, which always carries a ``request_id`` (the agent answers a repeated id with the
  first request's attachments, so a retry after a lost answer cannot attach twice).
- Detach is never repeated once sent: a lost answer is reported, not guessed at (a repeated
  forced detach could kill processes that started meanwhile).

A read timeout counts as a lost answer, so an idempotent call may wait up to ``attempts``
times its read timeout in all; a repeated attach whose first request is still running gets
``409 busy`` (operation in progress) at once rather than waiting again.

Error *answers* (``409 busy`` and friends) are never retried here: they are the caller's to
judge (``AgentError.retryable``).
"""

from __future__ import annotations

import json
import os
import re
import ssl
import urllib.parse
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Generic, Literal, Self, TypeAlias, TypeVar

from .._structs import (
    AGENT_URL_ENV,
    DEFAULT_AGENT_URL,
    DEFAULT_WAIT_SECONDS,
    TOKEN_PATH_ENV,
    AttachRequestBody,
    GpuSelector,
    GpuUuid,
    PidRef,
    PidTarget,
    PodTarget,
    WireFormatError,
    check_detach_flags,
    parse_memory_text,
)
from .._version import __version__
from ._http import (
    AgentEndpoint,
    MalformedResponse,
    Stage,
    TransportFailure,
    decode_response,
    encode_request,
)
from .errors import (
    AgentClientError,
    AgentConnectionLost,
    AgentProtocolError,
    AgentUnavailable,
    ClientConfigError,
    InvalidRequest,
    error_from_response,
)
from .models import (
    Attachment,
    AttachmentState,
    Gpu,
    Health,
    IdleRelease,
    QueuedRequest,
    parse_attachment_state,
    parse_attachments,
    parse_gpus,
    parse_health,
    parse_idle_releases,
    parse_queue,
)

__all__ = [
    "AGENT_URL_ENV",
    "DEFAULT_AGENT_URL",
    "DEFAULT_WAIT_SECONDS",
    "TOKEN_PATH_ENV",
    "AnyTarget",
    "ApiCall",
    "BaseAgentClient",
    "ClientCore",
    "Prepared",
    "RetryPolicy",
    "Timeouts",
]


# RFC 6750 b64token: what a bearer token may contain (JWTs and hex tokens do).
_BEARER_TOKEN: Final = re.compile(r"[A-Za-z0-9\-._~+/]+=*")

AnyTarget: TypeAlias = PodTarget | PidRef | PidTarget
"""What a call may name as its target; ``None`` everywhere means "the caller itself"."""

_T = TypeVar("_T")


@dataclass(frozen=True)
class Timeouts:
    """Seconds to wait for a connection, and then for the whole answer.

    An attach waits ``read`` plus its ``wait_seconds`` (the agent may legitimately take that
    long to get a GPU).
    """

    connect: float = 5.0
    read: float = 30.0

    def __post_init__(self) -> None:
        if not (self.connect > 0 and self.read > 0):
            raise ValueError(f"timeouts must be positive seconds, got {self}")


@dataclass(frozen=True)
class RetryPolicy:
    """How often a call is attempted in all, and the pause before each repetition.

    Pauses double from ``first_delay`` up to ``max_delay``; ``RetryPolicy(attempts=1)``
    never repeats.
    """

    attempts: int = 3
    first_delay: float = 0.25
    max_delay: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.first_delay < 0 or self.max_delay < self.first_delay:
            raise ValueError(f"invalid retry policy {self}")

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt number ``attempt`` (counting from 1)."""
        return float(min(self.max_delay, self.first_delay * 2 ** (attempt - 1)))


DEFAULT_TIMEOUTS: Final = Timeouts()
DEFAULT_RETRY: Final = RetryPolicy()


@dataclass(frozen=True)
class ApiCall(Generic[_T]):
    """One API method: its request, how to read its success, and whether it may be repeated."""

    operation: str
    """What the call does, for messages: "attach 1 GPU"."""
    method: Literal["GET", "POST", "DELETE"]
    target: str
    """Path and query, e.g. ``/v1/attachments?pid=42``."""
    parse: Callable[[object], _T]
    """Turns the decoded JSON body (``None`` when ``has_body`` is false) into the result."""
    body: bytes | None = None
    has_body: bool = True
    """Whether a success carries a JSON body (``204`` answers do not)."""
    authenticated: bool = True
    idempotent: bool = False
    """May be sent again after the agent may have seen it."""
    extra_read_seconds: float = 0.0
    """Added to the read timeout: how long the agent itself may wait."""


def _no_body(value: object) -> None:
    """The result of a call whose success has no body."""


def _target_query(target: AnyTarget | None) -> dict[str, str]:
    if target is None:
        return {}
    if isinstance(target, PodTarget):
        query = {"pod": f"{target.namespace}/{target.name}"}
        if target.container is not None:
            query["container"] = target.container
        return query
    return {"pid": str(target.pid)}


def _with_query(path: str, query: Mapping[str, str]) -> str:
    return f"{path}?{urllib.parse.urlencode(query)}" if query else path


def _subject(target: AnyTarget | None) -> str:
    return "this notebook" if target is None else str(target)


def new_request_id() -> str:
    """A fresh id for an attach; matches the contract's ``[A-Za-z0-9._:-]{1,128}``."""
    return uuid.uuid4().hex


def list_gpus() -> ApiCall[tuple[Gpu, ...]]:
    return ApiCall("list the node's GPUs", "GET", "/v1/gpus", parse_gpus, idempotent=True)


def _attachments_read(
    target: AnyTarget | None, what: str, parse: Callable[[object], _T]
) -> ApiCall[_T]:
    """``GET /v1/attachments`` for ``target``, read by ``parse``."""
    return ApiCall(
        f"{what} {_subject(target)}",
        "GET",
        _with_query("/v1/attachments", _target_query(target)),
        parse,
        idempotent=True,
    )


def list_attachments(target: AnyTarget | None) -> ApiCall[tuple[Attachment, ...]]:
    return _attachments_read(target, "list the GPUs attached to", parse_attachments)


def attachment_state(target: AnyTarget | None) -> ApiCall[AttachmentState]:
    return _attachments_read(target, "read the GPU state of", parse_attachment_state)


def attach(
    count: int,
    *,
    target: AnyTarget | None,
    wait_seconds: float | None,
    request_id: str | None,
    mig: str | None = None,
    idle_release_seconds: float | None = None,
    gpus: Sequence[GpuUuid] = (),
    model: str | None = None,
    min_memory: int | str | None = None,
) -> ApiCall[tuple[Attachment, ...]]:
    """``request_id`` defaults to a new one: every attach is safe to repeat. ``mig``: attach
    MIG slices of that profile (``1g.10gb``) instead of whole GPUs. ``idle_release_seconds``:
    ask the agent to release them after that long unused (if stricter than its own policy).
    ``gpus``: attach exactly these (``count`` of them; ``Gpu.selectable`` says where the agent
    can). ``model`` (part of the product name, ``H100``) and ``min_memory`` (bytes, or text
    such as ``80G``, decimal, or ``40Gi``, binary) ask for GPUs by attribute; the agent checks
    them."""
    body = AttachRequestBody(count=count, request_id=request_id or new_request_id())
    if gpus:
        body["gpus"] = list(gpus)
    selector = GpuSelector(
        model, parse_memory_text(min_memory) if isinstance(min_memory, str) else min_memory
    )
    if selector.model is not None:
        body["model"] = selector.model
    if selector.min_memory is not None:
        body["min_memory"] = selector.min_memory
    if target is not None:
        body["target"] = target.to_wire()
    if wait_seconds is not None:
        body["wait_seconds"] = wait_seconds
    if mig is not None:
        body["mig"] = mig
    if idle_release_seconds is not None:
        body["idle_release_seconds"] = idle_release_seconds
    what = f"GPU{'' if count == 1 else 's'}" if mig is None else f"MIG {mig} slice(s)"
    if gpus:
        what += f" ({', '.join(gpus)})"
    if selector != GpuSelector():
        what += f" ({selector})"
    return ApiCall(
        f"attach {count} {what} to {_subject(target)}",
        "POST",
        "/v1/attachments",
        parse_attachments,
        body=json.dumps(body, separators=(",", ":")).encode(),
        idempotent=True,
        extra_read_seconds=DEFAULT_WAIT_SECONDS if wait_seconds is None else wait_seconds,
    )


def list_idle_releases(target: AnyTarget | None) -> ApiCall[tuple[IdleRelease, ...]]:
    return ApiCall(
        f"list the GPUs the idle policy took from {_subject(target)}",
        "GET",
        _with_query("/v1/idle-releases", _target_query(target)),
        parse_idle_releases,
        idempotent=True,
    )


def list_queued(target: AnyTarget | None) -> ApiCall[tuple[QueuedRequest, ...]]:
    return ApiCall(
        f"list the requests of {_subject(target)} waiting for GPUs",
        "GET",
        _with_query("/v1/queue", _target_query(target)),
        parse_queue,
        idempotent=True,
    )


def cancel_queued(request_id: str, target: AnyTarget | None = None) -> ApiCall[None]:
    return ApiCall(
        f"cancel the waiting request {request_id} of {_subject(target)}",
        "DELETE",
        _with_query(f"/v1/queue/{urllib.parse.quote(request_id, safe='')}", _target_query(target)),
        _no_body,
        has_body=False,
        idempotent=True,
    )


def _force_query(force: bool) -> dict[str, str]:
    return {"force": "true"} if force else {}


def detach(uuid_: GpuUuid | str, *, force: bool) -> ApiCall[None]:
    return ApiCall(
        f"{'force-' if force else ''}detach GPU {uuid_}",
        "DELETE",
        _with_query(f"/v1/attachments/{urllib.parse.quote(uuid_, safe='')}", _force_query(force)),
        _no_body,
        has_body=False,
    )


def detach_all(*, target: AnyTarget | None, force: bool, keep: bool = False) -> ApiCall[None]:
    """``keep``: suspend the target's CUDA processes into host memory first (the agent's
    ``keep=true``); never with ``force``: the agent's own refusal (``InvalidRequest``, the
    same words) is raised here, without sending anything."""
    try:
        check_detach_flags(force=force, keep=keep)
    except WireFormatError as error:
        raise InvalidRequest(
            error.message,
            status=400,
            code="invalid_request",
            retryable=False,
            extra={"field": error.field},
        ) from error
    query = {**_target_query(target), **_force_query(force)}
    if keep:
        query["keep"] = "true"
    what = "force-detach" if force else "detach"
    return ApiCall(
        f"{what} all GPUs of {_subject(target)}{' keeping its CUDA state' if keep else ''}",
        "DELETE",
        _with_query("/v1/attachments", query),
        _no_body,
        has_body=False,
    )


def health() -> ApiCall[Health]:
    return ApiCall(
        "check that the agent is alive",
        "GET",
        "/healthz",
        parse_health,
        authenticated=False,
        idempotent=True,
    )


@dataclass(frozen=True)
class Prepared:
    """One attempt of a call, ready to send."""

    payload: bytes
    read_timeout: float
    missing_token: str | None
    """Why no token was sent, if none was (for a 401's message)."""


class ClientCore:
    """Configuration plus the decisions of every call; shared by both clients."""

    def __init__(
        self,
        agent_url: str,
        *,
        token_path: Path | None,
        timeouts: Timeouts,
        retry: RetryPolicy,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        try:
            self.endpoint = AgentEndpoint.parse(agent_url)
        except ValueError as error:
            raise ClientConfigError(str(error)) from error
        self.token_path = token_path
        self.timeouts = timeouts
        self.retry = retry
        self.ssl_context = ssl_context
        if ssl_context is None and self.endpoint.scheme == "https":
            self.ssl_context = ssl.create_default_context()
        self._user_agent = f"jupyter-gpu-hotplug/{__version__}"

    def read_token(self) -> tuple[str | None, str | None]:
        """``(token, None)``, or ``(None, why there is none)``. Read anew on every call.

        The kubelet rotates projected tokens by swapping the file, so a cached token expires.
        A missing file is not an error: local mode on a unix socket identifies the caller by
        its peer credentials. A file that exists but cannot be read is one.
        """
        if self.token_path is None:
            return None, f"no token file is configured ({TOKEN_PATH_ENV} is not set)"
        try:
            text = self.token_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None, f"the token file {self.token_path} does not exist"
        except (OSError, UnicodeDecodeError) as error:
            detail = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise ClientConfigError(
                f"cannot read the GPU agent token file {self.token_path}: {detail}"
            ) from error
        token = text.strip()
        if not token:
            return None, f"the token file {self.token_path} is empty"
        if _BEARER_TOKEN.fullmatch(token) is None:
            raise ClientConfigError(
                f"the GPU agent token file {self.token_path} holds characters a bearer token "
                "cannot contain"
            )
        return token, None

    def prepare(self, call: ApiCall[_T]) -> Prepared:
        headers = {"User-Agent": self._user_agent, "Accept": "application/json"}
        missing_token = None
        if call.authenticated:
            token, missing_token = self.read_token()
            if token is not None:
                headers["Authorization"] = f"Bearer {token}"
        if call.body is not None:
            headers["Content-Type"] = "application/json"
        payload = encode_request(
            self.endpoint, call.method, call.target, headers=headers, body=call.body
        )
        return Prepared(payload, self.timeouts.read + call.extra_read_seconds, missing_token)

    def conclude(self, call: ApiCall[_T], prepared: Prepared, data: bytes) -> _T:
        """The result of a received answer, or the ``AgentClientError`` it amounts to.

        Raises ``TransportFailure`` when the answer was cut short (see ``after_failure``).
        """
        try:
            response = decode_response(data, method=call.method)
        except MalformedResponse as error:
            raise self._protocol_error(call, str(error)) from error
        if response.status >= 400:
            raise error_from_response(
                response.status,
                response.reason,
                response.body,
                agent_url=self.endpoint.url,
                operation=call.operation,
                missing_token=prepared.missing_token,
            )
        if not 200 <= response.status < 300:
            raise self._protocol_error(call, f"HTTP {response.status} {response.reason}")
        if not call.has_body:
            return call.parse(None)
        try:
            value = json.loads(response.body)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._protocol_error(call, f"the body is not JSON ({error})") from error
        try:
            return call.parse(value)
        except ValueError as error:
            raise self._protocol_error(call, str(error)) from error

    def after_failure(self, call: ApiCall[_T], failure: TransportFailure, *, attempt: int) -> float:
        """The pause before repeating ``call``, or raise the error that ends it."""
        repeatable = failure.stage is Stage.CONNECT or call.idempotent
        if repeatable and attempt < self.retry.attempts:
            return self.retry.delay(attempt)
        raise self._failure_error(call, failure, attempts=attempt) from failure

    def _failure_error(
        self, call: ApiCall[_T], failure: TransportFailure, *, attempts: int
    ) -> AgentClientError:
        if failure.stage is Stage.CONNECT:
            return AgentUnavailable(agent_url=self.endpoint.url, reason=failure.reason)
        return AgentConnectionLost(
            agent_url=self.endpoint.url,
            operation=call.operation,
            reason=failure.reason,
            timed_out=failure.timed_out,
            attempts=attempts,
        )

    def _protocol_error(self, call: ApiCall[_T], detail: str) -> AgentProtocolError:
        return AgentProtocolError(
            agent_url=self.endpoint.url, operation=call.operation, detail=detail
        )


class BaseAgentClient:
    """Configuration shared by ``AgentClient`` and ``AsyncAgentClient``.

    ``agent_url``: ``http://host:port``, ``https://host:port`` or ``unix:/path/to/agent.sock``.
    ``token_path``: the file holding the bearer token, re-read on every call; ``None`` (or a
    file that does not exist) sends no token. ``ssl_context`` applies to ``https`` only
    (default: the system's trusted CAs). No proxy settings apply: the agent is on this node.
    """

    def __init__(
        self,
        agent_url: str = DEFAULT_AGENT_URL,
        *,
        token_path: str | os.PathLike[str] | None = None,
        timeouts: Timeouts = DEFAULT_TIMEOUTS,
        retry: RetryPolicy = DEFAULT_RETRY,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._core = ClientCore(
            agent_url,
            token_path=None if token_path is None else Path(token_path),
            timeouts=timeouts,
            retry=retry,
            ssl_context=ssl_context,
        )

    @classmethod
    def from_environment(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        timeouts: Timeouts = DEFAULT_TIMEOUTS,
        retry: RetryPolicy = DEFAULT_RETRY,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Self:
        """A client configured the way the spawner configures the notebook pod.

        Reads ``GPU_HOTPLUG_AGENT_URL`` (default: the local-mode socket) and
        ``GPU_HOTPLUG_TOKEN_PATH`` (default: none) once, from ``environ`` or ``os.environ``.
        An empty variable counts as unset: spawners template them and may leave them blank.
        """
        env = os.environ if environ is None else environ
        return cls(
            env.get(AGENT_URL_ENV) or DEFAULT_AGENT_URL,
            token_path=env.get(TOKEN_PATH_ENV) or None,
            timeouts=timeouts,
            retry=retry,
            ssl_context=ssl_context,
        )

    @property
    def agent_url(self) -> str:
        return self._core.endpoint.url

    @property
    def token_path(self) -> Path | None:
        return self._core.token_path

    @property
    def timeouts(self) -> Timeouts:
        return self._core.timeouts

    @property
    def retry(self) -> RetryPolicy:
        return self._core.retry

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.agent_url!r}, token_path={self.token_path!r})"
