"""The agent's one door to the Kubernetes API: a thin adapter over the official client.

Why it exists: the rest of the backend should speak in pods, reviews and quotas, not in the
client's generated classes, and should never see its exceptions. This module is the only one
that imports ``kubernetes`` (import-linter); it

- reads and writes objects as plain JSON dicts (``_preload_content=False``): the generated
  models cost milliseconds per pod to build and validate, and the agent reads a handful of
  fields;
- runs every blocking call on its own small thread pool, so that a slow API server never
  occupies the threads that touch the host;
- maps ``ApiException`` and transport failures onto a small error hierarchy, split by what a
  caller can do about them (``KubeUnavailable`` may pass; the others will not);
- filters list results client-side as well as by selector, so that a server that ignores
  selectors (as test doubles may) cannot hand the agent someone else's pods;
- watches with a deadline: ``watch_pods`` streams events from a resource version and ends by
  the deadline whatever the server does (the response is closed from the caller's side).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, TypeAlias, TypeVar

import kubernetes.client
import kubernetes.config
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

__all__ = [
    "KubeApi",
    "KubeConflict",
    "KubeError",
    "KubeForbidden",
    "KubeInvalid",
    "KubeNotFound",
    "KubeObject",
    "KubeUnavailable",
    "WatchEvent",
    "api_error",
    "label_selector",
    "matches_labels",
]

log = logging.getLogger(__name__)

KubeObject: TypeAlias = dict[str, Any]
"""A Kubernetes object as the API serves it in JSON."""

_T = TypeVar("_T")
_CONNECT_TIMEOUT: Final = 5.0
_REQUEST_TIMEOUT: Final = 15.0
_THREADS: Final = 16
_COMPONENT: Final = "gpu-hotplug-agent"


class KubeError(Exception):
    """The API server refused or failed a request; ``status`` is its HTTP status (0: none)."""

    def __init__(self, message: str, *, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class KubeNotFound(KubeError):
    """404: the object does not exist (any more)."""


class KubeConflict(KubeError):
    """409: it exists already, or a precondition (uid, resource version) failed."""


class KubeForbidden(KubeError):
    """403: RBAC denies the agent, or an admission check (ResourceQuota) refused the object."""


class KubeInvalid(KubeError):
    """400/422: the request itself is wrong; retrying it cannot help."""


class KubeUnavailable(KubeError):
    """No answer, a timeout or a 5xx/429: retrying later may help."""


def api_error(error: Exception, what: str) -> KubeError:
    """The ``KubeError`` for a failed call (``what`` says which, for the message)."""
    if not isinstance(error, ApiException):
        return KubeUnavailable(f"{what}: the API server did not answer ({error})")
    status = int(error.status or 0)
    message, reason = str(error.reason or ""), ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        body = json.loads(error.body or "")
        message, reason = str(body.get("message") or message), str(body.get("reason") or "")
    kind: type[KubeError] = {
        404: KubeNotFound,
        409: KubeConflict,
        403: KubeForbidden,
        400: KubeInvalid,
        422: KubeInvalid,
    }.get(status, KubeUnavailable if status in (0, 429) or status >= 500 else KubeError)
    return kind(f"{what}: {status} {message}", status=status, reason=reason)


def label_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def matches_labels(obj: KubeObject, labels: Mapping[str, str]) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    return all(have.get(key) == value for key, value in labels.items())


def _on_node(obj: KubeObject, node_name: str | None) -> bool:
    return node_name is None or obj.get("spec", {}).get("nodeName") == node_name


@dataclass(frozen=True)
class WatchEvent:
    type: str
    """``ADDED``, ``MODIFIED``, ``DELETED`` (``BOOKMARK``s are consumed here)."""
    object: KubeObject


@dataclass(frozen=True)
class _PodFilter:
    """Which pods a watch reports: the API's selectors, checked again on our side (a fake or
    an older server may ignore a selector; a wrong event would be a wrong decision)."""

    namespace: str | None
    labels: Mapping[str, str]
    node_name: str | None

    def __call__(self, pod: KubeObject) -> bool:
        return (
            matches_labels(pod, self.labels)
            and _on_node(pod, self.node_name)
            and self.namespace in (None, pod.get("metadata", {}).get("namespace"))
        )


class _WatchReader:
    """One watch stream, read in a thread of its own and handed to the event loop.

    Why a thread: the official client reads a watch with blocking calls, and a watch lasts
    minutes; the shared pool's threads are for short calls. A daemon thread: a blocked read
    must never hold up the agent's exit. ``stop`` closes the response from the loop's side
    (the deadline passed, the caller left), which makes the blocked read fail in whatever way
    urllib3 fails: that is the end of the stream, not an error. The thread never raises: it
    passes events, then ``None`` (the end) or the error, through a queue.
    """

    def __init__(self, request: Callable[[], Any], *, wanted: _PodFilter) -> None:
        self._request = request
        self._wanted = wanted
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue()
        self._responses: list[Any] = []
        self._stopped = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._read, name="gpu-hotplug-watch", daemon=True).start()

    async def next(self, deadline: float) -> WatchEvent | None:
        """The next event, or None at the end of the stream or at ``deadline``."""
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            return None
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            # that arrives with an item, and the watch would go on.
            async with asyncio.timeout(timeout):
                item = await self._queue.get()
        except TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        self._stopped.set()
        for response in self._responses:
            with contextlib.suppress(Exception):
                # urllib3 ≥ 2.3: unblocks a read in progress in the reader thread.
                getattr(response, "shutdown", lambda: None)()
                response.close()

    def _put(self, item: WatchEvent | BaseException | None) -> None:
        if self._stopped.is_set():
            return  # nobody listens any more; the loop may even be closed
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _read(self) -> None:
        try:
            response = self._request()
            self._responses.append(response)
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if self._stopped.is_set():
                    break
                if line:
                    self._event(json.loads(line))
            self._put(None)
        except KubeError as e:
            self._put(e)
        except Exception as e:
            self._put(None if self._stopped.is_set() else api_error(e, "watch pods"))

    def _event(self, event: KubeObject) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            raise KubeUnavailable(f"watch pods: {obj.get('message', obj)}")
        if kind in ("ADDED", "MODIFIED", "DELETED") and self._wanted(obj):
            self._put(WatchEvent(kind, obj))


class KubeApi:
    """Async calls on the Kubernetes API for the node agent (see the module docstring)."""

    def __init__(self, api_client: Any, *, request_timeout: float = _REQUEST_TIMEOUT) -> None:
        self._client = api_client
        self._core = kubernetes.client.CoreV1Api(api_client)
        self._authn = kubernetes.client.AuthenticationV1Api(api_client)
        self._authz = kubernetes.client.AuthorizationV1Api(api_client)
        self._node = kubernetes.client.NodeV1Api(api_client)
        self._timeout = (_CONNECT_TIMEOUT, request_timeout)
        self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="gpu-hotplug-kube")

    @classmethod
    def connect(cls, kubeconfig: Path | None) -> KubeApi:
        """From a kubeconfig file, or the pod's service account when ``kubeconfig`` is None."""
        configuration = kubernetes.client.Configuration()
        if kubeconfig is None:
            kubernetes.config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(kubeconfig), client_configuration=configuration
            )
        return cls(kubernetes.client.ApiClient(configuration))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def _blocking(self, what: str, function: Callable[..., Any], /, **kwargs: Any) -> Any:
        """``function(**kwargs)`` here and now, the JSON body decoded, errors mapped."""
        try:
            response = function(_preload_content=False, _request_timeout=self._timeout, **kwargs)
            return json.loads(response.data or b"null")
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as e:
            raise api_error(e, what) from e

    async def _call(self, what: str, function: Callable[..., Any], /, **kwargs: Any) -> Any:
        """``_blocking`` in the adapter's pool."""
        call = functools.partial(self._blocking, what, function, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    # -- pods ----------------------------------------------------------------------------------

    def read_pod(self, namespace: str, name: str) -> KubeObject | None:
        """The pod, or None when there is none (blocking: for the resolver's worker thread)."""
        try:
            pod: KubeObject = self._blocking(
                f"get pod {namespace}/{name}",
                self._core.read_namespaced_pod,
                namespace=namespace,
                name=name,
            )
        except KubeNotFound:
            return None
        return pod

    async def get_pod(self, namespace: str, name: str) -> KubeObject | None:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self.read_pod, namespace, name
        )

    async def list_pods(
        self,
        namespace: str | None = None,
        *,
        labels: Mapping[str, str] | None = None,
        node_name: str | None = None,
    ) -> tuple[list[KubeObject], str]:
        """Pods with all ``labels`` (on ``node_name``), and the list's resource version."""
        selectors: dict[str, Any] = {}
        if labels:
            selectors["label_selector"] = label_selector(labels)
        if node_name is not None:
            selectors["field_selector"] = f"spec.nodeName={node_name}"
        if namespace is None:
            answer = await self._call(
                "list pods", self._core.list_pod_for_all_namespaces, **selectors
            )
        else:
            answer = await self._call(
                f"list pods in {namespace}",
                self._core.list_namespaced_pod,
                namespace=namespace,
                **selectors,
            )
        pods = [
            pod
            for pod in answer.get("items") or []
            if matches_labels(pod, labels or {})
            and _on_node(pod, node_name)
            and namespace in (None, pod.get("metadata", {}).get("namespace"))
        ]
        return pods, str(answer.get("metadata", {}).get("resourceVersion") or "")

    async def create_pod(self, namespace: str, pod: KubeObject) -> KubeObject:
        created: KubeObject = await self._call(
            f"create pod in {namespace}",
            self._core.create_namespaced_pod,
            namespace=namespace,
            body=pod,
        )
        return created

    async def annotate_pod(
        self, namespace: str, name: str, annotations: Mapping[str, str]
    ) -> KubeObject:
        """Merge ``annotations`` into the pod's (the other annotations stay)."""
        pod: KubeObject = await self._call(
            f"annotate pod {namespace}/{name}",
            self._core.patch_namespaced_pod,
            namespace=namespace,
            name=name,
            body={"metadata": {"annotations": dict(annotations)}},
        )
        return pod

    async def delete_pod(self, namespace: str, name: str, *, uid: str | None = None) -> bool:
        """Delete the pod (only if it still has ``uid``); False when it was gone already.

        Always graceful (the pod's own grace period): the object then stays until the kubelet
        has stopped the pod and freed its devices, so "gone from the API" means "free". A
        forced deletion (grace 0) would remove the object while the kubelet still holds them.
        """
        body: KubeObject = {}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await self._call(
                f"delete pod {namespace}/{name}",
                self._core.delete_namespaced_pod,
                namespace=namespace,
                name=name,
                body=body,
            )
        except KubeNotFound:
            return False
        except KubeConflict:
            return False  # the uid precondition failed: a new pod took the name
        return True

    async def watch_pods(
        self,
        namespace: str | None = None,
        *,
        labels: Mapping[str, str] | None = None,
        node_name: str | None = None,
        resource_version: str = "",
        deadline: float,
    ) -> AsyncIterator[WatchEvent]:
        """Events on matching pods from ``resource_version`` until ``deadline``
        (``time.monotonic()``); ends early when the server closes the stream."""
        remaining = max(1, int(deadline - time.monotonic()) + 1)
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": remaining,
        }
        if labels:
            kwargs["label_selector"] = label_selector(labels)
        if node_name is not None:
            kwargs["field_selector"] = f"spec.nodeName={node_name}"
        if resource_version:
            kwargs["resource_version"] = resource_version
        if namespace is None:
            request = functools.partial(self._core.list_pod_for_all_namespaces, **kwargs)
        else:
            request = functools.partial(
                self._core.list_namespaced_pod, namespace=namespace, **kwargs
            )
        reader = _WatchReader(
            functools.partial(
                request, _preload_content=False, _request_timeout=(_CONNECT_TIMEOUT, remaining + 5)
            ),
            wanted=_PodFilter(namespace, labels or {}, node_name),
        )
        reader.start()
        try:
            while (event := await reader.next(deadline)) is not None:
                yield event
        finally:
            reader.stop()

    # -- namespaces ----------------------------------------------------------------------------

    async def namespace_labels(self, name: str) -> dict[str, str] | None:
        """The labels of Namespace ``name``, or None when there is no such namespace."""
        try:
            namespace: KubeObject = await self._call(
                f"get namespace {name}", self._core.read_namespace, name=name
            )
        except KubeNotFound:
            return None
        return dict((namespace.get("metadata") or {}).get("labels") or {})

    # -- authentication and authorization ------------------------------------------------------

    async def review_token(self, token: str, *, audiences: list[str]) -> KubeObject:
        """The ``status`` of a TokenReview of ``token`` for ``audiences``."""
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": audiences},
        }
        answer: KubeObject = await self._call(
            "TokenReview", self._authn.create_token_review, body=review
        )
        status: KubeObject = answer.get("status") or {}
        return status

    async def review_access(
        self, user: KubeObject, *, namespace: str, verb: str, name: str
    ) -> tuple[bool, str]:
        """A SubjectAccessReview of ``verb`` on ``pods/gpus`` ``namespace/name`` for ``user``
        (a TokenReview's ``status.user``): (allowed, reason)."""
        attributes = {
            "namespace": namespace,
            "verb": verb,
            "group": "",
            "resource": "pods",
            "subresource": "gpus",
            "name": name,
        }
        return await self._review_access(user, resourceAttributes=attributes)

    async def review_read(self, user: KubeObject, *, path: str) -> tuple[bool, str]:
        """A SubjectAccessReview of ``get`` on the non-resource URL ``path`` for ``user``
        (as the API server authorizes its own ``/metrics``): (allowed, reason)."""
        return await self._review_access(user, nonResourceAttributes={"path": path, "verb": "get"})

    async def _review_access(self, user: KubeObject, **attributes: KubeObject) -> tuple[bool, str]:
        """A SubjectAccessReview of ``attributes`` for ``user``: (allowed, reason)."""
        spec: KubeObject = {
            "user": user.get("username", ""),
            "groups": user.get("groups") or [],
            "uid": user.get("uid", ""),
            "extra": user.get("extra") or {},
            **attributes,
        }
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": spec,
        }
        answer = await self._call(
            "SubjectAccessReview", self._authz.create_subject_access_review, body=review
        )
        status = answer.get("status") or {}
        return bool(status.get("allowed")), str(status.get("reason") or "")

    # -- runtime classes, events -------------------------------------------------------

    def read_runtime_class_handler(self, name: str) -> str | None:
        """The handler of RuntimeClass ``name``, or None when there is no such class
        (blocking: for the resolver's worker thread)."""
        try:
            runtime_class = self._blocking(
                f"get runtime class {name}", self._node.read_runtime_class, name=name
            )
        except KubeNotFound:
            return None
        handler = runtime_class.get("handler")
        return str(handler) if handler else None

    async def create_event(
        self, pod: KubeObject, *, reason: str, message: str, warning: bool = False
    ) -> None:
        """Record an Event on ``pod`` (shown by ``kubectl describe pod``). Best effort: an
        event that cannot be written is logged, never raised."""
        metadata = pod.get("metadata", {})
        namespace = metadata.get("namespace", "default")
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{metadata.get('name', 'pod')}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": namespace,
                "name": metadata.get("name"),
                "uid": metadata.get("uid"),
            },
            "reason": reason,
            "message": message,
            "type": "Warning" if warning else "Normal",
            "source": {"component": _COMPONENT},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self._call(
                f"create event on pod {namespace}/{metadata.get('name')}",
                self._core.create_namespaced_event,
                namespace=namespace,
                body=event,
            )
        except KubeError as e:
            log.warning("could not record event %s on pod %s: %s", reason, metadata.get("name"), e)
