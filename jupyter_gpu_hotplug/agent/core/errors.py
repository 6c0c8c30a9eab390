"""The agent API's errors: one class per error code of DESIGN §3, and nothing else.

Why one hierarchy: the service and its parts raise these, and exactly one place (the API's base
handler) turns them into a response, from ``status``, ``code`` and ``to_body()``. No code below
the API knows about HTTP beyond these attributes, and no library error crosses the API
unconverted: whatever is not an ``AgentError`` becomes an ``InternalError`` (a 5xx is a bug).

Every message says what happened *and* what to do about it, because it reaches people through
the notebook toolbar, the ``%gpu`` magic and the CLI verbatim.

``retryable`` sorts errors the way kopf sorts temporary from permanent ones: whether the *same*
request, sent again later, may succeed (``insufficient_gpus``: GPUs may be released meanwhile)
or whether something must change first (``invalid_request``: it never will).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from ..._structs import STATUS_BY_CODE, ErrorBody, ErrorCode, ErrorExtra, GpuUuid, ProcessInfo

_REGISTRY: dict[ErrorCode, type[AgentError]] = {}


class AgentError(Exception):
    """Base of every error the agent API answers with."""

    status: ClassVar[int]
    """From ``_structs.STATUS_BY_CODE``: the contract defines it once."""
    code: ClassVar[ErrorCode]
    default_hint: ClassVar[str]
    """What to do, when the raiser has nothing more specific to say."""
    default_retryable: ClassVar[bool]

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        retryable: bool | None = None,
        extra: ErrorExtra | None = None,
    ) -> None:
        self.message = f"{message}; {hint or self.default_hint}"
        self.retryable = self.default_retryable if retryable is None else retryable
        self.extra = ErrorExtra(**(extra or {}))
        super().__init__(self.message)

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        # A class that names a code is that code's error; a subclass that only refines one
        # (``BodyTooLarge`` is an ``invalid_request`` answered 413) keeps its own status and
        # leaves the registry to its parent.
        if "code" in cls.__dict__:
            cls.status = STATUS_BY_CODE[cls.code]
            _REGISTRY[cls.code] = cls

    def to_body(self) -> ErrorBody:
        """The JSON response body: ``{"error", "message", "retryable", ...extra}``."""
        return {
            **self.extra,
            "error": self.code,
            "message": self.message,
            "retryable": self.retryable,
        }


class InvalidRequest(AgentError):
    """400: the request is malformed; ``field`` names the offending input when there is one."""

    code = "invalid_request"
    default_hint = "the request format is described in /v1/openapi.json"
    default_retryable = False

    def __init__(self, message: str, *, field: str | None = None, hint: str | None = None) -> None:
        super().__init__(
            message, hint=hint, extra=None if field is None else ErrorExtra(field=field)
        )
        self.field = field

    @classmethod
    def request_id_reused(cls, request_id: str, *, used: int, requested: int) -> InvalidRequest:
        """An attach repeats a ``request_id`` of this target but asks for another count: it is
        neither a retry (which must be identical) nor a new request."""
        return cls(
            f"request_id {request_id!r} was already used by this target for {used} GPU(s), "
            f"not {requested}",
            field="request_id",
            hint="use a new request_id for a new request",
        )


class BodyTooLarge(InvalidRequest):
    """413: the request body is over the limit; refused from its ``Content-Length`` before a
    byte of it is read, or (chunked) as soon as the chunks add up to more."""

    status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the request body is larger than {limit} bytes",
            field="body",
            hint="no request of this API needs more; send the JSON object alone",
        )


class Unauthenticated(AgentError):
    """401: no credentials, or credentials the agent does not accept."""

    code = "unauthenticated"
    default_hint = (
        "send 'Authorization: Bearer <token>' with the pod's gpu-hotplug service-account token "
        "(audience gpu-hotplug), or in local mode the token from the agent's state dir"
    )
    default_retryable = False


class Forbidden(AgentError):
    """403: the caller is known but may not do this (not its pod, over its GPU limit, ...)."""

    code = "forbidden"
    default_hint = (
        "act on your own pod only, or ask an administrator for RBAC on the pods/gpus subresource"
    )
    default_retryable = False

    @classmethod
    def over_gpu_limit(
        cls, *, limit: int, attached: int, requested: int, source: str | None = None
    ) -> Forbidden:
        """The target's limit forbids more (``source``: where that limit comes from, for a
        reader who must know which setting to change)."""
        origin = f" ({source})" if source else ""
        return cls(
            f"this pod may have at most {limit} GPU(s){origin}; it has {attached} and asked "
            f"for {requested} more",
            hint="release GPUs you no longer need, or ask for a profile with a higher limit",
            extra=ErrorExtra(limit=limit, attached=attached, requested=requested),
        )


class NotFound(AgentError):
    """404: the named pod, container, process or attachment does not exist (here)."""

    code = "not_found"
    default_hint = "check the name; the status command lists the GPUs and what is attached"
    default_retryable = False

    def __init__(self, resource: str, name: str, *, hint: str | None = None) -> None:
        super().__init__(
            f"{resource} {name!r} not found on this node",
            hint=hint,
            extra=ErrorExtra(resource=resource, name=name),
        )
        self.resource = resource
        self.name = name


class Busy(AgentError):
    """409 ``busy``: a GPU is in use by processes, or another operation holds the target.

    Use the constructors: the two cases differ in what to do and in ``retryable``.
    """

    code = "busy"
    default_hint = "try again in a moment"
    default_retryable = True

    def __init__(
        self,
        message: str,
        *,
        processes: Sequence[ProcessInfo] = (),
        uuid: GpuUuid | None = None,
        hint: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        extra = ErrorExtra(
            processes=[ProcessInfo(pid=p["pid"], command=p["command"]) for p in processes]
        )
        if uuid is not None:
            extra["uuid"] = uuid
        super().__init__(message, hint=hint, retryable=retryable, extra=extra)
        self.processes = tuple(processes)
        self.uuid = uuid

    @classmethod
    def gpu_in_use(cls, uuid: GpuUuid, processes: Sequence[ProcessInfo]) -> Busy:
        """Detach without force while processes of the target hold the device open."""
        return cls.gpus_in_use([uuid], processes)

    @classmethod
    def gpus_in_use(cls, uuids: Sequence[GpuUuid], processes: Sequence[ProcessInfo]) -> Busy:
        """``gpu_in_use`` for a detach of several GPUs at once (then no single ``uuid``)."""
        listing = ", ".join(f"{p['pid']} ({p['command']})" for p in processes)
        one = len(uuids) == 1
        subject = f"GPU {uuids[0]} is" if one else f"GPUs {', '.join(uuids)} are"
        return cls(
            f"{subject} in use by process(es) {listing}",
            processes=processes,
            uuid=uuids[0] if one else None,
            hint="stop them (e.g. shut down the kernel using the GPU) or detach with force=true, "
            "which kills them",
            retryable=False,
        )

    @classmethod
    def operation_in_progress(cls, target: str) -> Busy:
        """The per-target lock is taken: one attach or detach at a time per target."""
        return cls(
            f"another attach or detach of {target} is in progress",
            hint="wait for it to finish, then try again",
            retryable=True,
        )


class Unavailable(Busy):
    """503 ``busy``: the agent cannot take this request now — its connections are spoken for,
    or a scan of the target's processes ran past its deadline — and says when to try again
    (``retry_after`` seconds, also sent as ``Retry-After``). Nothing was changed."""

    status = 503

    def __init__(self, message: str, *, retry_after: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint, retryable=True)
        self.retry_after = retry_after
        self.extra["retry_after"] = retry_after


class InsufficientGpus(AgentError):
    """409 ``insufficient_gpus``: fewer free GPUs on this node than requested; ``message``
    replaces the count when the request named its GPUs (which one is taken, and by whom)."""

    code = "insufficient_gpus"
    default_hint = "ask for fewer, release GPUs you no longer need, or try again later"
    default_retryable = True

    def __init__(
        self,
        *,
        free: int,
        requested: int,
        hint: str | None = None,
        retryable: bool | None = None,
        message: str | None = None,
    ) -> None:
        super().__init__(
            message or f"{requested} GPU(s) requested but {free} free on this node",
            hint=hint,
            retryable=retryable,
            extra=ErrorExtra(free=free, requested=requested),
        )
        self.free = free
        self.requested = requested


class TargetNotReady(AgentError):
    """422: the target cannot take a GPU (container not running; VM sandbox, never).

    Pass ``retryable=False`` when waiting cannot help (an unsupported runtime).
    """

    code = "target_not_ready"
    default_hint = "wait until the container is running, then try again"
    default_retryable = True


class LookupFailed(TargetNotReady):
    """422 ``target_not_ready``: the API server or the container runtime did not answer, so
    whether the target still runs is not known now.

    Its own class because "not known" must never be read as "gone": a waiting request, a
    reconciliation pass or a lost-holder revoke that took it for an exit would answer 404,
    release a GPU its container still holds, or forget a suspension (``Resolver.lookup``).
    """

    default_hint = "the node's API server or container runtime did not answer; try again"


class Timeout(AgentError):
    """504: a step did not finish within ``wait_seconds``; everything begun was rolled back."""

    code = "timeout"
    default_hint = (
        "nothing was left behind; try again with a larger wait_seconds, or look at the "
        "namespace's events for why the holder pod did not start"
    )
    default_retryable = True

    def __init__(self, message: str, *, wait_seconds: float, hint: str | None = None) -> None:
        super().__init__(message, hint=hint, extra=ErrorExtra(wait_seconds=wait_seconds))
        self.wait_seconds = wait_seconds


class InternalError(AgentError):
    """500: anything not foreseen. Always a bug; ``request_id`` finds it in the agent's log."""

    code = "internal_error"
    default_hint = "this is a bug in the agent: report it with the request id and the agent's log"
    # Temporary: the failure may have been transient, and attach retries are idempotent.
    default_retryable = True

    def __init__(self, *, request_id: str, hint: str | None = None) -> None:
        super().__init__(
            f"the agent failed unexpectedly (request id {request_id})",
            hint=hint,
            extra=ErrorExtra(request_id=request_id),
        )
        self.request_id = request_id


ERRORS_BY_CODE: Mapping[ErrorCode, type[AgentError]] = {
    code: _REGISTRY[code] for code in STATUS_BY_CODE
}
"""Every API error class by its code: one per code of ``ErrorCode``."""
