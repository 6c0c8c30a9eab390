"""The fake apiserver on the wire: tornado over HTTP on 127.0.0.1, in a thread of its own.

Why a thread with its own event loop: the agent under test runs as a subprocess and the test
itself may be sync or async; the control plane must keep answering (and streaming watches)
whatever the test's thread is doing. Everything that touches the ``Cluster`` runs on that
loop; other threads go through ``ApiServer.call``.

Paths: ``/version``, ``/api``, ``/apis``, discovery per group version, and for every resource
of ``resources.py`` ``/api/v1/...`` or ``/apis/<group>/<version>/...`` with
``namespaces/<ns>/`` where namespaced: list (``labelSelector``, ``fieldSelector``), watch
(``watch=true``, ``resourceVersion``, ``timeoutSeconds``, ``allowWatchBookmarks``), create,
get, update, patch (three formats), delete (``DeleteOptions`` in the body or query),
deletecollection, and the ``status`` subresources.

On request of a test: bearer-token authentication and rule-based authorisation of every
resource request (``authorize_callers``, 401/403 like the real authenticator and RBAC), and
injected failures (``failures``: chosen requests answered with an error).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import tornado.httpserver
import tornado.iostream
import tornado.netutil
import tornado.web

from .cluster import Cluster
from .errors import ApiError, bad_request
from .resources import (
    BY_PATH,
    PODS,
    SERVER_VERSION,
    Resource,
    api_group,
    api_group_list,
    api_versions,
    resource_list,
)
from .reviews import DEFAULT_AUDIENCES, Token
from .store import Change, Watcher

_T = TypeVar("_T")
log = logging.getLogger(__name__)

DEFAULT_WATCH_TIMEOUT: Final = 1800.0
"""Seconds a watch without ``timeoutSeconds`` lasts (the apiserver's min-request-timeout)."""


@dataclass
class Failure:
    """An injected failure: the next ``times`` requests with ``method`` whose URI contains
    ``uri_part`` get ``code`` (e.g. 503 while "the apiserver is down", 429, 500)."""

    method: str
    uri_part: str
    code: int
    times: int
    reason: str = "ServiceUnavailable"
    message: str = "the server is currently unable to handle the request"

    def matches(self, method: str, uri: str) -> bool:
        if self.times <= 0 or method != self.method or self.uri_part not in uri:
            return False
        self.times -= 1
        return True


@dataclass(frozen=True)
class Target:
    resource: Resource
    namespace: str
    name: str
    subresource: str


def parse_target(group: str, version: str, rest: str) -> Target:
    """The resource a path below a group version names; 404 if none."""
    parts = [p for p in rest.split("/") if p]
    namespace = ""
    if len(parts) >= 3 and parts[0] == "namespaces":
        candidate = BY_PATH.get((group, version, parts[2]))
        if candidate is not None and candidate.namespaced:
            namespace, parts = parts[1], parts[2:]
    if not parts or len(parts) > 3:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    resource = BY_PATH.get((group, version, parts[0]))
    if resource is None or (resource.namespaced and not namespace and len(parts) > 1):
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    name = parts[1] if len(parts) > 1 else ""
    subresource = parts[2] if len(parts) > 2 else ""
    return Target(resource, namespace, name, subresource)


class _Base(tornado.web.RequestHandler):
    SUPPORTED_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")

    def initialize(self, server: ApiServer) -> None:
        self.server = server
        self.caller: Token | None = None
        """Who made the request, when callers are checked (``authorize_callers``)."""

    @property
    def cluster(self) -> Cluster:
        return self.server.cluster

    def prepare(self) -> None:
        method, uri = self.request.method or "", self.request.uri or ""
        self.server.requests.append((method, uri))
        for failure in self.server.failures:
            if failure.matches(method, uri):
                raise ApiError(failure.code, failure.reason, failure.message)
        if self.server.authorize_callers and isinstance(self, _Resources):
            self.check_access()

    def answer(self, body: Any, code: int = 200) -> None:
        self.set_status(code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if not isinstance(value, ApiError):  # an ApiError is an answer, not a failure
            super().log_exception(typ, value, tb)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        error = kwargs.get("exc_info", (None, None))[1]
        if isinstance(error, ApiError):
            self.answer(error.status(), error.code)
            return
        if isinstance(error, tornado.web.HTTPError):
            self.answer(ApiError(status_code, "NotFound", str(error)).status(), status_code)
            return
        log.error("fake apiserver failed on %s %s", self.request.method, self.request.uri)
        self.answer(ApiError(500, "InternalError", repr(error)).status(), 500)

    def json_body(self) -> Any:
        if not self.request.body:
            return None
        try:
            return json.loads(self.request.body)
        except ValueError as error:
            raise bad_request(f"the body of the request is not valid JSON: {error}") from None


class _Discovery(_Base):
    def get(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        body: Any = None
        if parts == ["version"]:
            body = SERVER_VERSION
        elif parts == ["api"]:
            body = api_versions()
        elif parts == ["api", "v1"]:
            body = resource_list("", "v1")
        elif parts == ["apis"]:
            body = api_group_list()
        elif len(parts) == 2 and parts[0] == "apis":
            body = api_group(parts[1])
        elif len(parts) == 3 and parts[0] == "apis":
            body = resource_list(parts[1], parts[2])
        if body is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        self.answer(body)


class _Resources(_Base):
    def target(self, group: str, version: str, rest: str) -> Target:
        return parse_target(group or "", version, rest)

    def check_access(self) -> None:
        """Authenticate the bearer token and authorise the request with the registered
        rules, as the apiserver's authenticator and RBAC do (401, 403)."""
        group, version, rest = self.path_args
        target = self.target(group, version, rest)
        header = self.request.headers.get("Authorization", "")
        token, _ = self.cluster.reviews.authenticate(
            header.removeprefix("Bearer ").strip(),
            DEFAULT_AUDIENCES,
            lambda ns, name: self.cluster.store.find(PODS, ns, name),
        )
        if token is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        verb = _verb(self.request.method or "", target, self.get_query_argument("watch", ""))
        attributes = {
            "verb": verb,
            "group": target.resource.group,
            "version": target.resource.version,
            "resource": target.resource.plural,
            "subresource": target.subresource,
            "namespace": target.namespace,
            "name": target.name,
        }
        if self.cluster.reviews.allowed(token, attributes):
            self.caller = token
            return
        resource = target.resource.plural + (f"/{target.subresource}" if target.subresource else "")
        scope = (
            f'in the namespace "{target.namespace}"' if target.namespace else "at the cluster scope"
        )
        raise ApiError(
            403,
            "Forbidden",
            f"{target.resource.plural} {f'{target.name!r} ' if target.name else ''}is forbidden: "
            f'User "{token.username}" cannot {verb} resource "{resource}" in API group '
            f'"{target.resource.group}" {scope}',
        )

    async def get(self, group: str, version: str, rest: str) -> None:
        target = self.target(group, version, rest)
        if target.name:
            self.answer(self.cluster.read(target.resource, target.namespace, target.name))
        elif self.get_query_argument("watch", "") in ("true", "1"):
            await self._watch(target)
        else:
            self.answer(
                self.cluster.list(
                    target.resource,
                    target.namespace,
                    self.get_query_argument("labelSelector", None),
                    self.get_query_argument("fieldSelector", None),
                )
            )

    def post(self, group: str, version: str, rest: str) -> None:
        target = self.target(group, version, rest)
        if target.name:
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method")
        body = self.json_body()
        if self.caller is not None:
            self._check_owner_references(target, body)
        created = self.cluster.create(target.resource, target.namespace, body)
        self.answer(created, 201)

    def _check_owner_references(self, target: Target, body: Any) -> None:
        """The OwnerReferencesPermissionEnforcement admission plugin: setting
        ``blockOwnerDeletion`` needs ``update`` on the owner's ``finalizers`` subresource."""
        assert self.caller is not None
        meta = (body.get("metadata") if isinstance(body, dict) else None) or {}
        for ref in meta.get("ownerReferences") or []:
            if not ref.get("blockOwnerDeletion"):
                continue
            owner = next(
                (
                    r
                    for r in BY_PATH.values()
                    if (r.kind, r.api_version) == (ref.get("kind"), ref.get("apiVersion"))
                ),
                None,
            )
            attributes = {
                "verb": "update",
                "group": owner.group if owner else "",
                "resource": owner.plural if owner else "",
                "subresource": "finalizers",
                "namespace": target.namespace if owner is None or owner.namespaced else "",
                "name": ref.get("name", ""),
            }
            if owner is None or not self.cluster.reviews.allowed(self.caller, attributes):
                name = meta.get("name") or meta.get("generateName", "")
                raise ApiError(
                    403,
                    "Forbidden",
                    f'{target.resource.plural} "{name}" is forbidden: cannot set '
                    "blockOwnerDeletion if an ownerReference refers to a resource you can't set "
                    f'finalizers on: User "{self.caller.username}" cannot update resource '
                    f'"{attributes["resource"]}/finalizers" in API group "{attributes["group"]}"'
                    f' in the namespace "{target.namespace}"',
                )

    def put(self, group: str, version: str, rest: str) -> None:
        target = self.target(group, version, rest)
        self.answer(
            self.cluster.replace(
                target.resource,
                target.namespace,
                target.name,
                self.json_body(),
                target.subresource,
            )
        )

    def patch(self, group: str, version: str, rest: str) -> None:
        target = self.target(group, version, rest)
        self.answer(
            self.cluster.patch(
                target.resource,
                target.namespace,
                target.name,
                self.request.headers.get("Content-Type", ""),
                self.json_body(),
                target.subresource,
            )
        )

    def delete(self, group: str, version: str, rest: str) -> None:
        target = self.target(group, version, rest)
        options = self.json_body() or {}
        grace = self.get_query_argument("gracePeriodSeconds", None)
        if grace is not None:
            options["gracePeriodSeconds"] = int(grace)
        policy = self.get_query_argument("propagationPolicy", None)
        if policy is not None:
            options["propagationPolicy"] = policy
        if target.name:
            self.answer(
                self.cluster.delete(target.resource, target.namespace, target.name, options)
            )
            return
        listed = self.cluster.list(
            target.resource,
            target.namespace,
            self.get_query_argument("labelSelector", None),
            self.get_query_argument("fieldSelector", None),
        )
        for item in listed["items"]:
            meta = item["metadata"]
            self.cluster.delete(target.resource, meta.get("namespace", ""), meta["name"], options)
        self.answer({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"})

    # ----- watch ------------------------------------------------------------------------

    async def _watch(self, target: Target) -> None:
        resource = target.resource
        matches = self.cluster.selector(
            resource,
            self.get_query_argument("labelSelector", None),
            self.get_query_argument("fieldSelector", None),
        )
        timeout = float(self.get_query_argument("timeoutSeconds", "0") or 0)
        bookmarks = self.get_query_argument("allowWatchBookmarks", "") == "true"
        since_text = self.get_query_argument("resourceVersion", "") or "0"
        self.set_header("Content-Type", "application/json")
        store = self.cluster.store
        try:
            if since_text == "0":  # "any": current state as ADDED, then changes
                watcher = store.watch(resource, target.namespace, None)
                initial = self.cluster.list(resource, target.namespace, None, None)["items"]
                for obj in initial:
                    obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
                    if matches(obj):
                        self.write(json.dumps({"type": "ADDED", "object": obj}) + "\n")
            else:
                watcher = store.watch(resource, target.namespace, int(since_text))
        except ApiError as error:  # 410 Gone comes as an ERROR event, as from the real one
            self.write(json.dumps({"type": "ERROR", "object": error.status()}) + "\n")
            self.finish()
            return
        except ValueError:
            raise bad_request(f"invalid resourceVersion {since_text!r}") from None
        self._watcher: Watcher | None = watcher
        try:
            await self.flush()
            await self._stream(watcher, matches, timeout or DEFAULT_WATCH_TIMEOUT)
            if bookmarks:
                mark = {
                    "kind": resource.kind,
                    "apiVersion": resource.api_version,
                    "metadata": {"resourceVersion": str(store.revision)},
                }
                self.write(json.dumps({"type": "BOOKMARK", "object": mark}) + "\n")
            self.finish()
        except tornado.iostream.StreamClosedError:
            pass
        finally:
            store.unwatch(watcher)

    async def _stream(
        self, watcher: Watcher, matches: Callable[[dict[str, Any]], bool], timeout: float
    ) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            try:
                change = await asyncio.wait_for(watcher.queue.get(), left)
            except TimeoutError:
                return
            if change is None:
                return
            event = _event_for(change, matches)
            if event is not None:
                self.write(json.dumps(event) + "\n")
                await self.flush()

    def on_connection_close(self) -> None:
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.queue.put_nowait(None)


def _verb(method: str, target: Target, watch: str) -> str:
    """The RBAC verb of a request."""
    if method == "GET":
        if target.name:
            return "get"
        return "watch" if watch in ("true", "1") else "list"
    if method == "DELETE":
        return "delete" if target.name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def _event_for(change: Change, matches: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """The event a selector-filtered watch sees: entering the selection is ADDED, leaving it
    DELETED (as the watch cache does)."""
    now_matches = matches(change.object)
    if change.type == "MODIFIED":
        was = change.old is not None and matches(change.old)
        if now_matches and was:
            kind = "MODIFIED"
        elif now_matches:
            kind = "ADDED"
        elif was:
            kind = "DELETED"
        else:
            return None
    elif now_matches:
        kind = change.type
    else:
        return None
    return {"type": kind, "object": change.object}


class ApiServer:
    """The cluster and its HTTP server on a private event loop thread."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        """(method, uri) of every request served, in order."""
        self.authorize_callers = False
        """Authenticate and authorise every resource request (discovery stays open)."""
        self.failures: list[Failure] = []
        """Injected failures, consumed in order of registration."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="fake-apiserver", daemon=True)
        self._http: tornado.httpserver.HTTPServer | None = None
        self.port = 0
        self.cluster: Cluster

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        ready = threading.Event()
        self._ready = ready
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the fake apiserver did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    async def _serve(self) -> None:
        self.cluster = Cluster()
        application = tornado.web.Application(
            [
                (
                    r"/(version|api|apis|api/v1|apis/[^/]+|apis/[^/]+/[^/]+)/?",
                    _Discovery,
                    {"server": self},
                ),
                (r"/api/()(v1)/(.+)", _Resources, {"server": self}),
                (r"/apis/([^/]+)/([^/]+)/(.+)", _Resources, {"server": self}),
            ],
            log_function=lambda handler: None,
        )
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        self.port = sockets[0].getsockname()[1]
        self._http = tornado.httpserver.HTTPServer(application)
        self._http.add_sockets(sockets)
        self._ready.set()

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the server's own loop (where it must not wait on it)."""
        return threading.current_thread() is self._thread

    def call(self, function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run ``function`` on the server's loop and return its result (or raise its error);
        called on that loop already (from a controller), it simply runs ``function``."""
        if self.on_loop_thread():
            return function(*args, **kwargs)

        async def run() -> _T:
            return function(*args, **kwargs)

        future: concurrent.futures.Future[_T] = asyncio.run_coroutine_threadsafe(run(), self.loop)
        return future.result(timeout=60)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            self.cluster.store.close_watches()
            if self._http is not None:
                self._http.stop()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._http.close_all_connections(), 5)

        with contextlib.suppress(concurrent.futures.TimeoutError):
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
