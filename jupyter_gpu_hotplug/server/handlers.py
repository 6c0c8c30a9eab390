"""REST handlers under ``<base_url>/gpu-hotplug/api/``, in jupyter_server's uniform shape.

Each verb is ``@web.authenticated`` then ``@authorized`` on the ``gpu_hotplug`` resource,
parses its input (``validation``), makes one call to the ``HotplugManager`` and answers JSON
with an explicit status (201 with ``Location`` for an attach, 204 for a detach). Failures are
turned into answers in one place, ``GPUHotplugAPIHandler.write_error``, through
``errors.error_reply``: the agent's errors keep its status, code and message; nothing a
handler raises ever reaches the browser as a traceback. The module ends, as jupyter_server's
service handler modules do, with ``AUTH_RESOURCE``, the URL patterns and ``default_handlers``;
the extension app registers that list as it is, so a handler added here is served (and covered
by the tests that walk ``default_handlers``) without further wiring.

Routes (relative to the server's ``base_url``; JSON shapes in ``models``):

- ``GET gpu-hotplug/api/version`` → ``{"version"}``
- ``GET gpu-hotplug/api/openapi.json`` → this API's OpenAPI document, with this server's
  ``max_count`` and mode (``openapi``)
- ``GET gpu-hotplug/api/gpus[?kernel_id=K]`` → ``GpusJson``
- ``GET gpu-hotplug/api/history`` → ``HistoryJson``: the node's readings of the last hour
- ``GET gpu-hotplug/api/attribution`` → ``AttributionJson``: which kernel of this server
  uses how much of each GPU
- ``POST gpu-hotplug/api/attach`` ``{count, kernel_id?, wait_seconds?, request_id?}`` → 201
  ``AttachJson``
- ``POST gpu-hotplug/api/detach`` ``{uuid | "all", force?, kernel_id?}`` → 204
- ``POST gpu-hotplug/api/cancel`` ``{request_id, kernel_id?}`` → 204: a waiting attach
  leaves the agent's queue
- ``GET gpu-hotplug/api/stream[?kernel_id=K]`` → ``text/event-stream`` of ``metrics``
  (``GpusJson``), ``progress`` (``ProgressJson``) and ``error`` (an error body plus
  ``status``) events
"""

from __future__ import annotations

import contextlib
import json
import urllib.parse
from typing import Any, Final

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from jupyter_server.utils import url_path_join
from tornado import iostream, web

from .._httpkit import Refusal, RefusalLogging, StreamedBodyHandler, allow_header
from .._version import __version__
from .errors import BodyTooLarge, error_reply, internal_error_reply
from .manager import HotplugManager
from .openapi import openapi_document
from .stream import STREAM_PREAMBLE, Subscription
from .validation import (
    MAX_BODY_BYTES,
    parse_attach,
    parse_cancel,
    parse_detach,
    parse_kernel_query,
)

AUTH_RESOURCE = "gpu_hotplug"
"""The resource name our handlers ask the server's ``Authorizer`` about."""

MANAGER_SETTING: Final = "gpu_hotplug_manager"
"""Key of the ``HotplugManager`` in the web application's settings."""

_EVENT_STREAM: Final = "text/event-stream; charset=utf-8"


class GPUHotplugAPIHandler(RefusalLogging, ExtensionHandlerMixin, APIHandler):
    """Base of every handler here: one auth resource, the manager, errors as JSON."""

    auth_resource = AUTH_RESOURCE

    @property
    def manager(self) -> HotplugManager:
        manager: HotplugManager = self.settings[MANAGER_SETTING]
        return manager

    def finish_json(self, status: int, payload: object) -> None:
        self.set_status(status)
        self.finish(json.dumps(payload))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Our errors and the agent's as ``{error, message, reason, retryable, ...}``.

        tornado's own ``HTTPError`` (403 from the authorizer, 405...) keeps jupyter_server's
        answer, with ``Allow`` on a 405 and 401 for a caller without credentials; anything
        else is a bug and gets a bare 500 (its traceback is in the log).
        """
        error = kwargs["exc_info"][1] if "exc_info" in kwargs else None
        if status_code == 405:
            self.set_header("Allow", allow_header(type(self)))
        if status_code == 403 and not self.current_user:
            # tornado's ``authenticated`` refuses a caller without credentials with 403; RFC
            # 9110 (and this API's document) say 401, with how to authenticate.
            self.set_status(401)
            self.set_header("WWW-Authenticate", 'token realm="jupyter_server"')
            status_code = 401
        if error is None or isinstance(error, web.HTTPError):
            super().write_error(status_code, **kwargs)
            return
        reply = error_reply(error) or internal_error_reply()
        self.set_status(reply.status)
        self.finish(json.dumps(reply.body))

    def log_refusal(self, error: BaseException) -> bool:
        # An expected failure (bad input, no agent, a busy GPU) is one warning line, not an
        # "Uncaught exception" with a traceback; bugs keep tornado's full report.
        reply = error_reply(error)
        if reply is None:
            return False
        self.log.warning(
            "%d %s: %s", reply.status, self._request_summary(), reply.body.get("message")
        )
        return True


class BodyHandler(StreamedBodyHandler, GPUHotplugAPIHandler):
    """A handler with a JSON body of at most ``MAX_BODY_BYTES``, refused with 413 unread.

    jupyter_server reads a whole body (up to its ``max_body_size``, 512 MiB) before a handler
    runs; streamed through the HTTP kit (``_httpkit.StreamedBodyHandler``, as the agent's API
    does), the declared ``Content-Length`` is checked when the headers arrive (the 413 is sent
    at once, with a lingering close), and a chunked body is counted as it comes and dropped
    past the limit.
    """

    max_body = MAX_BODY_BYTES
    too_large = BodyTooLarge

    async def prepare(self) -> None:  # type: ignore[override]  # APIHandler's is async
        if not await self.screen():
            await super().prepare()

    def unread_refusal(self, error: Exception) -> Refusal | None:
        """Our 413, answered before the body is read (a client still sending reads it
        instead of a reset)."""
        reply = error_reply(error)
        if reply is None:
            return None
        self.log.warning("%d %s: %s", reply.status, self._request_summary(), "body too large")
        return Refusal(
            reply.status,
            json.dumps(reply.body).encode(),
            {"Content-Type": "application/json; charset=UTF-8", "Cache-Control": "no-store"},
        )


class VersionHandler(GPUHotplugAPIHandler):
    """``GET version``: lets the frontend check the server side is installed and matches it."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.finish(json.dumps({"version": __version__}))


class OpenAPIHandler(GPUHotplugAPIHandler):
    """``GET openapi.json``: this API's document as this server serves it (``openapi``)."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        manager = self.manager
        self.finish(openapi_document(mode=manager.mode, max_count=manager.max_count))


class GpusHandler(GPUHotplugAPIHandler):
    """``GET gpus``: the kernel's (or pod's) GPUs with live metrics, and the node's counts."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        kernel_id = parse_kernel_query(self.request.query_arguments)
        self.finish_json(200, await self.manager.gpus(kernel_id))


class HistoryHandler(GPUHotplugAPIHandler):
    """``GET history``: the node's GPU readings of the last hour, the same for every page
    (the charts' history survives a reload)."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.finish_json(200, self.manager.history())


class AttributionHandler(GPUHotplugAPIHandler):
    """``GET attribution``: each GPU's processes by kernel of this server (memory, SM
    utilisation), for a user with several notebooks deciding which to stop."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.finish_json(200, await self.manager.attribution())


class AttachHandler(BodyHandler):
    """``POST attach``: attach GPUs; progress is published on the stream meanwhile."""

    @web.authenticated
    @authorized
    async def post(self) -> None:
        request = parse_attach(self.body, max_count=self.manager.max_count)
        result = await self.manager.attach(request)
        location = url_path_join(self.base_url, GPUS_PATH)
        if request.kernel_id is not None:
            location += "?" + urllib.parse.urlencode({"kernel_id": request.kernel_id})
        self.set_header("Location", location)
        self.finish_json(201, result)


class DetachHandler(BodyHandler):
    """``POST detach``: release one GPU or all of them."""

    @web.authenticated
    @authorized
    async def post(self) -> None:
        await self.manager.detach(parse_detach(self.body))
        self.set_status(204)
        self.finish()


class CancelHandler(BodyHandler):
    """``POST cancel``: stop waiting for a free GPU (the attach's ``POST`` then fails).

    A ``POST`` with a body like ``detach`` rather than ``DELETE`` of a queue URL: the kernel
    travels in the body as everywhere else in this API, and the browser's code stays one shape.
    """

    @web.authenticated
    @authorized
    async def post(self) -> None:
        await self.manager.cancel(parse_cancel(self.body))
        self.set_status(204)
        self.finish()


class StreamHandler(GPUHotplugAPIHandler):
    """``GET stream``: server-sent events until the client leaves or the server stops.

    Server-sent events rather than a websocket: one-way is all that is needed, and plain
    HTTP passes JupyterHub's proxy and its authentication like every other request.
    """

    _subscription: Subscription | None = None

    @web.authenticated
    @authorized
    async def get(self) -> None:
        kernel_id = parse_kernel_query(self.request.query_arguments)
        subscription = self.manager.subscribe(kernel_id)
        self._subscription = subscription
        try:
            self.set_header("Content-Type", _EVENT_STREAM)
            self.set_header("Cache-Control", "no-cache, no-store")
            # Tells buffering reverse proxies (nginx) to pass each event on at once.
            self.set_header("X-Accel-Buffering", "no")
            # The client leaving is how a stream normally ends: nothing to report.
            with contextlib.suppress(iostream.StreamClosedError):
                self.write(STREAM_PREAMBLE)
                await self.flush()
                while (event := await subscription.next()) is not None:
                    self.write(event.encode())
                    await self.flush()
        finally:
            self.manager.unsubscribe(subscription)
        self.finish(set_content_type=_EVENT_STREAM)

    def on_connection_close(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
        super().on_connection_close()


API_PREFIX = "/gpu-hotplug/api"
"""Relative to the server's ``base_url``; the extension app prepends it."""
GPUS_PATH = f"{API_PREFIX}/gpus"
VERSION_URL = rf"{API_PREFIX}/version"
OPENAPI_URL = rf"{API_PREFIX}/openapi\.json"
GPUS_URL = rf"{API_PREFIX}/gpus"
HISTORY_URL = rf"{API_PREFIX}/history"
ATTRIBUTION_URL = rf"{API_PREFIX}/attribution"
ATTACH_URL = rf"{API_PREFIX}/attach"
DETACH_URL = rf"{API_PREFIX}/detach"
CANCEL_URL = rf"{API_PREFIX}/cancel"
STREAM_URL = rf"{API_PREFIX}/stream"

default_handlers: list[tuple[str, type[GPUHotplugAPIHandler]]] = [
    (VERSION_URL, VersionHandler),
    (OPENAPI_URL, OpenAPIHandler),
    (GPUS_URL, GpusHandler),
    (HISTORY_URL, HistoryHandler),
    (ATTRIBUTION_URL, AttributionHandler),
    (ATTACH_URL, AttachHandler),
    (DETACH_URL, DetachHandler),
    (CANCEL_URL, CancelHandler),
    (STREAM_URL, StreamHandler),
]
