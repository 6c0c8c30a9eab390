"""The agent API's tornado handlers: thin, uniform, and the only place errors become HTTP.

Why the shape: every request goes through ``ApiHandler``. As soon as its headers arrive, it
refuses a body above the limit (from ``Content-Length``; a chunked one as chunks arrive) and
authenticates the caller of a protected verb (bearer token, or the unix-socket peer's
container bound to the connection when it was accepted: see ``connection``) — before the body,
so an unauthenticated client never holds a connection through a body phase (issue 25); a
verb the route does not have is a 405 for anyone. A request refused while its body is unread
is answered with a lingering close, so the client reads the answer instead of a reset (the
body plumbing is the HTTP kit's, ``_httpkit.StreamedBodyHandler``, the server extension's
too). A connection let in on the token holders' reserve (``limits``) must show the token.
Every answer to an authenticated caller is logged with who called and what the request
acted on (``_audit``): refusals in ``log_exception``, successes in ``finish`` — the agent's log
is the audit trail of what it changed in other containers. ``write_error`` turns an
``AgentError`` into its status and JSON body — and anything else into a JSON 500
``internal_error`` carrying a request id, logged with its traceback (a 5xx is a bug, and the id
finds it in the log). Each verb then parses its input with ``validation``, calls one
``AgentService`` method and writes the result with an explicit status (201 for POST, 204 for
DELETE). No logic lives here; the service never sees tornado.

The routes and statuses served here are exactly those of ``openapi.json``; tests check it.
"""

from __future__ import annotations

import json
import logging
import uuid
from asyncio import Future
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

from tornado import web

from ..._httpkit import (
    ExcInfo,
    Refusal,
    RefusalLogging,
    StreamedBodyHandler,
    allow_header,
    implements,
)
from ..._structs import ErrorBody, TargetRef
from ..core.errors import (
    AgentError,
    BodyTooLarge,
    InternalError,
    InvalidRequest,
    NotFound,
    Unavailable,
)
from ..core.metrics import CONTENT_TYPE, AgentMetrics
from ..core.seams import Caller, Identity
from ..core.service import AgentService
from .connection import connection_of
from .limits import RETRY_AFTER, admission_of
from .validation import (
    MAX_BODY_BYTES,
    check_query_names,
    parse_attach_request,
    parse_detach_all,
    parse_force,
    parse_gpu_uuid,
    parse_request_id,
    parse_target_query,
)

__all__ = [
    "ATTACHMENTS_URL",
    "ATTACHMENT_URL",
    "GPUS_URL",
    "HEALTH_URL",
    "IDLE_RELEASES_URL",
    "METRICS_URL",
    "OPENAPI_URL",
    "QUEUED_URL",
    "QUEUE_URL",
    "READY_URL",
    "ApiContext",
    "Unwell",
    "api_only_handlers",
    "default_handlers",
    "metrics_handlers",
]

log = logging.getLogger(__name__)

HEALTH_URL: Final = r"/healthz"
READY_URL: Final = r"/readyz"
METRICS_URL: Final = r"/metrics"
OPENAPI_URL: Final = r"/v1/openapi\.json"
GPUS_URL: Final = r"/v1/gpus"
ATTACHMENTS_URL: Final = r"/v1/attachments"
ATTACHMENT_URL: Final = r"/v1/attachments/([^/]+)"
IDLE_RELEASES_URL: Final = r"/v1/idle-releases"
QUEUE_URL: Final = r"/v1/queue"
QUEUED_URL: Final = r"/v1/queue/([^/]+)"

_JSON: Final = "application/json"
_TARGET_QUERY: Final = ("pod", "container", "pid")


@dataclass(frozen=True)
class Unwell:
    """Why ``/healthz`` or ``/readyz`` answers 503: the state word and the reason."""

    status: Literal["starting", "stopping", "failing"]
    reason: str


@dataclass(frozen=True)
class ApiContext:
    """What the handlers reach through ``self.settings["gpu_hotplug"]``."""

    service: AgentService
    identity: Identity
    metrics: AgentMetrics
    openapi: bytes
    health: Callable[[], Unwell | None]
    """The cached liveness verdict: None when alive, else why not."""
    readiness: Callable[[], Unwell | None]
    """The cached readiness verdict: None when serving, else why not (starting, stopping)."""


class ApiHandler(RefusalLogging, StreamedBodyHandler):
    """Base of every agent route (see the module docstring)."""

    max_body = MAX_BODY_BYTES
    too_large = BodyTooLarge

    route: ClassVar[str] = "unknown"
    """The route as it appears in metrics labels (never the raw path: its cardinality)."""
    protected: ClassVar[bool] = True
    """Its verbs need an authenticated caller (checked at the headers)."""

    caller: Caller | None = None
    target: str | None = None
    """What the request acts on, for the audit fields (``_audit``): the target as the request
    names it (``self``: the caller's own container), a GPU, or a queued request."""
    _request_id: str | None = None

    @property
    def context(self) -> ApiContext:
        context: ApiContext = self.settings["gpu_hotplug"]
        return context

    @property
    def request_id(self) -> str:
        if self._request_id is None:
            self._request_id = uuid.uuid4().hex[:16]
        return self._request_id

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", f"{_JSON}; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Request-Id", self.request_id)

    def compute_etag(self) -> None:
        return None

    def _request_summary(self) -> str:
        # tornado's access log names the caller by remote_ip, which is "0.0.0.0" for every
        # unix-socket caller; there the identity bound at accept says who it is.
        connection = connection_of(self.request)
        if connection.peer is None:
            return super()._request_summary()
        peer = connection.peer
        container = connection.cgroups or "no container"
        return (
            f"{self.request.method} {self.request.uri} "
            f"(pid {peer.pid} uid {peer.uid}, container {container})"
        )

    # --- request -------------------------------------------------------------------------------

    async def prepare(self) -> None:
        # What must happen before the body arrives (module docstring): a body that is too
        # big, and a caller who may not call, are refused without reading it.
        await self.screen(self._authenticate_at_headers)

    async def _authenticate_at_headers(self) -> None:
        """Authenticate the caller of a verb this route serves (any other is a 405 for all)."""
        if self.protected and implements(type(self), self.request.method or ""):
            await self.authenticate()

    def unread_refusal(self, error: Exception) -> Refusal | None:
        """An ``AgentError`` answered with its body still unread: logged and counted here, as
        ``log_exception`` and ``on_finish`` would (the kit then writes it and lingers)."""
        if not isinstance(error, AgentError):
            return None
        self.log_exception(type(error), error, None)
        self._count(error.status)
        return Refusal(
            error.status,
            json.dumps(error.to_body(), separators=(",", ":")).encode(),
            self._error_headers(error),
        )

    def _error_headers(self, error: AgentError) -> dict[str, str]:
        headers = {
            "Content-Type": f"{_JSON}; charset=utf-8",
            "Cache-Control": "no-store",
            "X-Request-Id": self.request_id,
        }
        if isinstance(error, Unavailable):
            headers["Retry-After"] = str(error.retry_after)
        return headers

    async def authenticate(self) -> Caller:
        """The caller, from the bearer token or the connection's bound identity (once per
        request: ``prepare`` asks first, at the headers, for every verb the route serves; a
        verb it does not serve is a 405 for anyone). A connection let in on the token
        holders' reserve must show the token (``limits``)."""
        if self.caller is None:
            caller = await self._identify()
            admission = admission_of(self.request)
            if admission is not None:
                if admission.probation and not caller.privileged:
                    raise Unavailable(
                        "the agent's connections are all in use; the few left are kept for "
                        "callers with the agent token",
                        retry_after=RETRY_AFTER,
                        hint="try again in a moment",
                    )
                admission.token = admission.token or caller.privileged
            self.caller = caller
        return self.caller

    async def _identify(self) -> Caller:
        """Who calls, as the API's routes know callers (a token, or the connection's bound
        identity)."""
        return await self.context.identity.authenticate(
            authorization=self.request.headers.get("Authorization"),
            connection=connection_of(self.request),
        )

    def aim(self, target: TargetRef | None) -> TargetRef | None:
        """Note ``target`` (None: the caller itself) for the audit fields; return it."""
        self.target = "self" if target is None else str(target)
        return target

    def _audit(self) -> dict[str, str]:
        """The fields of every log line about an answer: the request id, and where known who
        called and on what (a refused or unauthenticated request may not have got that far)."""
        fields = {"request_id": self.request_id}
        if self.caller is not None:
            fields["caller"] = str(self.caller)
        if self.target is not None:
            fields["target"] = self.target
        return fields

    def query(self, *allowed: str) -> dict[str, list[bytes]]:
        """The query arguments, refusing names the route does not know."""
        arguments = self.request.query_arguments
        check_query_names(arguments, allowed=allowed)
        return arguments

    # --- response ------------------------------------------------------------------------------

    def finish(self, chunk: str | bytes | dict[Any, Any] | None = None) -> Future[None]:
        # Every success of an authenticated caller, in the refusals' shape (``log_exception``)
        # and before the answer leaves: the one place every verb's answer passes.
        if self.caller is not None and self.get_status() < 400 and not self._finished:
            log.info(
                "%s %s -> %d",
                self.request.method,
                self.request.path,
                self.get_status(),
                extra=self._audit(),
            )
        return super().finish(chunk)

    def reply(self, body: object, *, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(body, separators=(",", ":")))

    def reply_empty(self) -> None:
        self.set_status(204)
        self.clear_header("Content-Type")
        self.finish()

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        error = kwargs.get("exc_info", (None, None, None))[1]
        body: ErrorBody
        if isinstance(error, AgentError):
            status, body = error.status, error.to_body()
        elif isinstance(error, web.HTTPError) and error.status_code < 500:
            status, body = error.status_code, self._protocol_error(error.status_code)
        else:
            failure = InternalError(request_id=self.request_id)
            status, body = failure.status, failure.to_body()
        if status == 405:
            self.set_header("Allow", allow_header(type(self)))
        self.set_status(status)
        self.set_header("Content-Type", f"{_JSON}; charset=utf-8")
        if isinstance(error, Unavailable):
            self.set_header("Retry-After", str(error.retry_after))
        self.finish(json.dumps(body, separators=(",", ":")))

    def _protocol_error(self, status: int) -> ErrorBody:
        """Errors tornado raises itself (an unsupported method, a bad request line)."""
        if status == 405:
            message = f"method {self.request.method} is not allowed on {self.request.path}"
        else:
            message = f"the request was refused with HTTP status {status}"
        return InvalidRequest(message).to_body()

    def log_refusal(self, error: BaseException) -> bool:
        # Every refusal says why in the log, beside the access line's bare status: the operator
        # of a node reads this log, not the caller's answer (refused identities are also the
        # audit trail).
        if isinstance(error, AgentError):
            log.info(
                "%s %s -> %d %s: %s",
                self.request.method,
                self.request.path,
                error.status,
                error.code,
                error.message,
                extra=self._audit(),
            )
            return True
        if isinstance(error, web.HTTPError) and error.status_code < 500:
            log.info(
                "%s %s -> %d",
                self.request.method,
                self.request.path,
                error.status_code,
                extra=self._audit(),
            )
            return True
        return False

    def log_bug(self, exc_info: ExcInfo) -> None:
        typ, value, tb = exc_info
        log.error(
            "internal error in %s %s (request id %s)",
            self.request.method,
            self.request.path,
            self.request_id,
            exc_info=(typ, value, tb) if typ is not None and value is not None else True,
            extra={"request_id": self.request_id},
        )

    def on_finish(self) -> None:
        self._count(self.get_status())

    def _count(self, status: int) -> None:
        self.context.metrics.http_requests.labels(
            method=self.request.method or "", route=self.route, status=str(status)
        ).inc()


# --- routes ------------------------------------------------------------------------------------


class HealthHandler(ApiHandler):
    """``/healthz``, liveness: 200 while the agent works (starting included), 503 once its
    ledger stops answering (a restart may help). Never a 500: a probe must understand it."""

    route = "/healthz"
    protected = False

    def get(self) -> None:
        self._verdict(self.context.health())

    def _verdict(self, problem: Unwell | None) -> None:
        if problem is None:
            self.reply({"status": "ok"})
        else:
            self.reply({"status": problem.status, "reason": problem.reason}, status=503)


class ReadyHandler(HealthHandler):
    """``/readyz``, readiness: 503 with the reason while starting, stopping or failing."""

    route = "/readyz"

    def get(self) -> None:
        self._verdict(self.context.readiness())


class AgentReadHandler(ApiHandler):
    """A read of the agent's own documents, not of a target: its reader is authorized for
    the route's path (Kubernetes: RBAC on the non-resource URL, as the API server's own
    ``/metrics``), never anonymous (issue 31)."""

    async def _identify(self) -> Caller:
        return await self.context.identity.authenticate_reader(
            authorization=self.request.headers.get("Authorization"),
            connection=connection_of(self.request),
            path=self.route,
        )


class MetricsHandler(AgentReadHandler):
    route = "/metrics"

    async def get(self) -> None:
        await self.authenticate()
        await self.context.service.refresh_gpu_metrics()
        self.set_header("Content-Type", CONTENT_TYPE)
        self.finish(self.context.metrics.render())


class OpenApiHandler(AgentReadHandler):
    route = "/v1/openapi.json"

    async def get(self) -> None:
        await self.authenticate()
        self.finish(self.context.openapi)


class GpusHandler(ApiHandler):
    route = "/v1/gpus"

    async def get(self) -> None:
        caller = await self.authenticate()
        self.reply(await self.context.service.gpus(caller))


class AttachmentsHandler(ApiHandler):
    route = "/v1/attachments"

    async def get(self) -> None:
        caller = await self.authenticate()
        target = self.aim(parse_target_query(self.query(*_TARGET_QUERY)))
        self.reply(await self.context.service.attachments(caller, target))

    async def post(self) -> None:
        caller = await self.authenticate()
        self.query()
        request = parse_attach_request(self.body)
        self.aim(request.target)
        result = await self.context.service.attach(caller, request)
        if result["attachments"]:
            target = result["attachments"][0]["target"]
            if "pid" in target:
                self.set_header("Location", f"/v1/attachments?pid={target['pid']}")
        self.reply(result, status=201)

    async def delete(self) -> None:
        caller = await self.authenticate()
        arguments = self.query(*_TARGET_QUERY, "force", "keep")
        target = self.aim(parse_target_query(arguments))
        force, keep = parse_detach_all(arguments)
        await self.context.service.detach_all(caller, target, force=force, keep=keep)
        self.reply_empty()


class AttachmentHandler(ApiHandler):
    route = "/v1/attachments/{uuid}"

    async def delete(self, raw_uuid: str) -> None:
        caller = await self.authenticate()
        gpu = parse_gpu_uuid(raw_uuid)
        self.target = f"GPU {gpu}"
        force = parse_force(self.query("force"))
        await self.context.service.detach(caller, gpu, force=force)
        self.reply_empty()


class IdleReleasesHandler(ApiHandler):
    route = "/v1/idle-releases"

    async def get(self) -> None:
        caller = await self.authenticate()
        target = self.aim(parse_target_query(self.query(*_TARGET_QUERY)))
        self.reply(await self.context.service.idle_releases(caller, target))


class QueueHandler(ApiHandler):
    route = "/v1/queue"

    async def get(self) -> None:
        caller = await self.authenticate()
        target = self.aim(parse_target_query(self.query(*_TARGET_QUERY)))
        self.reply(await self.context.service.queued(caller, target))


class QueuedRequestHandler(ApiHandler):
    route = "/v1/queue/{request_id}"

    async def delete(self, raw_request_id: str) -> None:
        caller = await self.authenticate()
        target = self.aim(parse_target_query(self.query(*_TARGET_QUERY)))
        request_id = parse_request_id(raw_request_id)
        self.target = f"queued request {request_id} of {self.target}"
        await self.context.service.cancel_queued(caller, request_id, target)
        self.reply_empty()


class UnknownRouteHandler(ApiHandler):
    """Every other path: a JSON 404 (without authentication: probing paths tells nothing)."""

    route = "unknown"
    protected = False

    def _not_found(self, *args: str) -> None:
        raise NotFound("route", self.request.path, hint="the API is described in /v1/openapi.json")

    get = post = put = patch = delete = head = options = _not_found


default_handlers: list[tuple[str, type[ApiHandler]]] = [
    (HEALTH_URL, HealthHandler),
    (READY_URL, ReadyHandler),
    (METRICS_URL, MetricsHandler),
    (OPENAPI_URL, OpenApiHandler),
    (GPUS_URL, GpusHandler),
    (ATTACHMENTS_URL, AttachmentsHandler),
    (ATTACHMENT_URL, AttachmentHandler),
    (IDLE_RELEASES_URL, IdleReleasesHandler),
    (QUEUE_URL, QueueHandler),
    (QUEUED_URL, QueuedRequestHandler),
]
"""Every route of the API, in the order of ``openapi.json``."""

metrics_handlers: list[tuple[str, type[ApiHandler]]] = [
    (HEALTH_URL, HealthHandler),
    (METRICS_URL, MetricsHandler),
]
"""What a metrics address of its own serves (``--metrics-listen``): no API, no caller."""

api_only_handlers: list[tuple[str, type[ApiHandler]]] = [
    route for route in default_handlers if route not in metrics_handlers[1:]
]
"""The API's routes when ``/metrics`` has an address of its own (``/healthz`` stays: probes)."""
