"""REST handlers under ``<base_url>/gpu-hotplug/api/``, in jupyter_server's uniform shape.

Each verb is ``@web.authenticated`` then ``@authorized`` on the ``gpu_hotplug`` resource, answers
JSON, and leaves error bodies to ``APIHandler.write_error``. The module ends, as jupyter_server's
service handler modules do, with ``AUTH_RESOURCE``, the URL patterns and ``default_handlers``;
the extension app registers that list as it is, so a handler added here is served (and covered by
the tests that walk ``default_handlers``) without further wiring.
"""

from __future__ import annotations

import json

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web

from .._version import __version__

AUTH_RESOURCE = "gpu_hotplug"
"""The resource name our handlers ask the server's ``Authorizer`` about."""


class GPUHotplugAPIHandler(ExtensionHandlerMixin, APIHandler):
    """Base of every handler here: one auth resource, access to our ``ExtensionApp``."""

    auth_resource = AUTH_RESOURCE


class VersionHandler(GPUHotplugAPIHandler):
    """``GET version``: lets the frontend check the server side is installed and matches it."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.finish(json.dumps({"version": __version__}))


API_PREFIX = "/gpu-hotplug/api"
"""Relative to the server's ``base_url``; the extension app prepends it."""
VERSION_URL = rf"{API_PREFIX}/version"

default_handlers: list[tuple[str, type[GPUHotplugAPIHandler]]] = [
    (VERSION_URL, VersionHandler),
]
