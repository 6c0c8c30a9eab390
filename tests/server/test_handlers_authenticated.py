"""Every route and verb of our REST API is authenticated and authorized — checked generically.

The tests walk ``handlers.default_handlers``, so a handler added later is covered without
touching this file. Three independent angles:

- statically, each verb our code implements is ``@web.authenticated`` wrapping ``@authorized``
  (the order jupyter_server documents; it only recognises ``web.authenticated`` outermost);
- jupyter_server's own start-up check (a ``JupyterServerAuthWarning`` naming undecorated
  extension endpoints) stays silent about our handlers — with a control proving it still fires;
- on the wire: anonymous requests are refused even on a server configured to allow
  unauthenticated access, and the authorizer is consulted with resource ``gpu_hotplug``.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from jupyter_server.auth.authorizer import Authorizer
from jupyter_server.auth.decorator import authorized
from jupyter_server.auth.utils import HTTP_METHOD_TO_AUTH_ACTION
from jupyter_server.base.handlers import APIHandler
from jupyter_server.serverapp import ServerApp
from jupyter_server.utils import JupyterServerAuthWarning, url_path_join
from tornado import web
from tornado.httpclient import HTTPClientError, HTTPResponse
from tornado.routing import PathMatches
from traitlets import List
from traitlets.config import Config

from jupyter_gpu_hotplug.server.handlers import AUTH_RESOURCE, default_handlers

Fetch = Callable[..., Awaitable[HTTPResponse]]

OUR_PACKAGE = "jupyter_gpu_hotplug"
BODY_VERBS = frozenset({"POST", "PUT", "PATCH"})


def _probe(self: Any) -> None:
    """Stands in for a handler method so we can learn what each decorator's wrapper looks like."""


# Every wrapper a decorator returns shares that decorator's inner code object, so comparing code
# objects identifies the decorator without relying on names or on jupyter_server's private check.
AUTHENTICATED = web.authenticated(_probe).__code__
AUTHORIZED = authorized(_probe).__code__


def _defining_class(handler: type[web.RequestHandler], name: str) -> type:
    return next(cls for cls in handler.__mro__ if name in vars(cls))


def _our_verbs(handler: type[web.RequestHandler]) -> list[str]:
    """The HTTP verbs whose implementation lives in our package (not inherited from upstream).

    Inherited ones, such as ``APIHandler.options`` (CORS pre-flight, deliberately anonymous), are
    jupyter_server's to vouch for.
    """
    return [
        verb
        for verb in handler.SUPPORTED_METHODS
        if _defining_class(handler, verb.lower()).__module__.startswith(OUR_PACKAGE)
    ]


def _decorator_layers(method: Callable[..., Any]) -> Iterator[object]:
    """The code objects of the wrappers around ``method``, outermost first."""
    while hasattr(method, "__wrapped__"):
        yield method.__code__
        method = method.__wrapped__


def _is_authenticated_then_authorized(method: Callable[..., Any]) -> bool:
    return list(_decorator_layers(method))[:2] == [AUTHENTICATED, AUTHORIZED]


def _sample_path(pattern: str) -> str:
    """A concrete path for a route pattern, with a placeholder for each captured group."""
    path = PathMatches(pattern).reverse(*["0"] * re.compile(pattern).groups)
    assert path is not None
    assert re.fullmatch(pattern, path), f"sample {path!r} does not match {pattern!r}: extend me"
    return path


ENDPOINTS = [
    pytest.param(pattern, handler, verb, id=f"{verb} {pattern}")
    for pattern, handler in default_handlers
    for verb in _our_verbs(handler)
]


def test_every_handler_implements_a_verb() -> None:
    # Guards the parametrisation below against silently covering nothing.
    assert default_handlers
    for pattern, handler in default_handlers:
        assert _our_verbs(handler), f"{handler.__name__} at {pattern} implements no HTTP verb"


@pytest.mark.parametrize(("pattern", "handler", "verb"), ENDPOINTS)
def test_verb_is_authenticated_then_authorized(
    pattern: str, handler: type[web.RequestHandler], verb: str
) -> None:
    method = getattr(handler, verb.lower())

    assert _is_authenticated_then_authorized(method), (
        f"{verb} of {handler.__name__} ({pattern}) must be decorated "
        "@web.authenticated then @authorized"
    )


class _Undecorated(APIHandler):
    async def get(self) -> None:
        self.finish("{}")


class _WrongOrder(APIHandler):
    @authorized
    @web.authenticated
    async def get(self) -> None:
        self.finish("{}")


class _OnlyAuthenticated(APIHandler):
    @web.authenticated
    async def get(self) -> None:
        self.finish("{}")


@pytest.mark.parametrize("handler", [_Undecorated, _WrongOrder, _OnlyAuthenticated])
def test_decoration_check_rejects_unsafe_handlers(handler: type[web.RequestHandler]) -> None:
    assert not _is_authenticated_then_authorized(handler.get)


def _mentions_our_handlers(text: str) -> bool:
    names = {handler.__name__ for _, handler in default_handlers}
    return any(name in text for name in names) or "/gpu-hotplug/" in text


def test_server_start_does_not_flag_our_handlers(
    jp_configurable_serverapp: Callable[..., ServerApp], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        app = jp_configurable_serverapp()

    assert OUR_PACKAGE in app.extension_manager.extension_apps
    flagged = [
        str(w.message)
        for w in caught
        if issubclass(w.category, JupyterServerAuthWarning)
        and _mentions_our_handlers(str(w.message))
    ]
    assert flagged == []
    logged = [
        r.getMessage()
        for r in caplog.records
        if "authenticat" in r.getMessage().lower() and _mentions_our_handlers(r.getMessage())
    ]
    assert logged == []


def test_server_start_check_still_flags_an_undecorated_handler(jp_serverapp: ServerApp) -> None:
    # The control for the test above: if jupyter_server stopped warning this way, a silent
    # start-up would prove nothing and this test says so.
    route = url_path_join(jp_serverapp.base_url, "/gpu-hotplug/api/undecorated-control")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jp_serverapp.web_app.add_handlers(".*$", [(route, _Undecorated)])  # type: ignore[no-untyped-call]

    assert any(
        issubclass(w.category, JupyterServerAuthWarning) and "_Undecorated" in str(w.message)
        for w in caught
    )


class RecordingDenyAllAuthorizer(Authorizer):
    """Refuses everything and remembers what it was asked, to prove ``@authorized`` is applied."""

    calls: List[tuple[str, str]] = List(
        help="(action, resource) of every authorization question asked."
    )

    def is_authorized(
        self, handler: web.RequestHandler, user: Any, action: str, resource: str
    ) -> bool:
        self.calls.append((action, resource))
        return False


def _request_kwargs(verb: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"method": verb}
    if verb in BODY_VERBS:
        kwargs.update(body="", allow_nonstandard_methods=True)
    return kwargs


async def _refused_with(fetch: Fetch, pattern: str, verb: str, **kwargs: Any) -> int:
    with pytest.raises(HTTPClientError) as caught:
        await fetch(_sample_path(pattern), **_request_kwargs(verb), **kwargs)
    return caught.value.code


class TestAnonymousRequests:
    """Anonymous requests are refused by our decorators, not only by the server's default."""

    @pytest.fixture(params=[False, True], ids=["server-denies-by-default", "server-allows-anon"])
    def jp_server_config(self, request: pytest.FixtureRequest, jp_server_config: Config) -> Config:
        # allow_unauthenticated_access=True is the legacy server setting (also reachable through
        # JUPYTER_SERVER_ALLOW_UNAUTHENTICATED_ACCESS): then only our own decorators stand
        # between an anonymous caller and the handler body. XSRF checks are off so that a refusal
        # here can only come from authentication.
        jp_server_config.ServerApp.allow_unauthenticated_access = request.param
        jp_server_config.ServerApp.disable_check_xsrf = True
        return jp_server_config

    @pytest.mark.parametrize(("pattern", "handler", "verb"), ENDPOINTS)
    async def test_is_forbidden(
        self, jp_fetch: Fetch, pattern: str, handler: type[web.RequestHandler], verb: str
    ) -> None:
        code = await _refused_with(jp_fetch, pattern, verb, headers={"Authorization": ""})

        # Refused by authentication: 401, as RFC 9110 and the extension's document say
        # (tornado's decorator raises 403; the base handler answers it as what it is).
        assert code == 401


class TestAuthorization:
    """An authenticated user still needs the authorizer's yes for resource ``gpu_hotplug``."""

    @pytest.fixture
    def jp_server_config(self, jp_server_config: Config) -> Config:
        jp_server_config.ServerApp.authorizer_class = RecordingDenyAllAuthorizer
        jp_server_config.ServerApp.disable_check_xsrf = True
        return jp_server_config

    @pytest.mark.parametrize(("pattern", "handler", "verb"), ENDPOINTS)
    async def test_denied_by_authorizer(
        self,
        jp_fetch: Fetch,
        jp_serverapp: ServerApp,
        pattern: str,
        handler: type[web.RequestHandler],
        verb: str,
    ) -> None:
        code = await _refused_with(jp_fetch, pattern, verb)

        authorizer = jp_serverapp.authorizer
        assert isinstance(authorizer, RecordingDenyAllAuthorizer)
        assert code == 403
        assert authorizer.calls == [(HTTP_METHOD_TO_AUTH_ACTION[verb], AUTH_RESOURCE)]
