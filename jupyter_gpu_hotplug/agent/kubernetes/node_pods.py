"""The pods of this node, kept current by list-and-watch: what the backend waits on.

Why it exists: an attach waits for its holder pods to run, the reconciler must learn at once
that a holder was evicted or a target pod deleted, and neither may poll the API server. One
watch of every pod bound to this node (``spec.nodeName``; filtered client-side as well) feeds
an in-memory view; waiters sleep on a condition that each event wakes, and listeners hear
about every change. A scope's view is rebuilt by a fresh list whenever its watch cannot resume
(the server closed it, or its resource version expired), so a missed event costs one list.

Scopes: by default one, every namespace. Given namespaces, one list-and-watch per namespace
instead — what an agent needs whose RBAC grants pods in those namespaces only (RoleBindings:
``rbac.namespaced`` in the chart), since listing across namespaces would be forbidden.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from typing import Final, TypeVar

from .kube import KubeApi, KubeError, KubeObject, WatchEvent

__all__ = ["NodePods", "pod_key"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_WATCH_SECONDS: Final = 240.0
_RETRY_SECONDS: Final = 1.0

Listener = Callable[[str, KubeObject], None]
"""Called with the event type (``ADDED``, ``MODIFIED``, ``DELETED``) and the pod."""


def pod_key(pod: KubeObject) -> tuple[str, str]:
    metadata = pod.get("metadata") or {}
    return str(metadata.get("namespace", "")), str(metadata.get("name", ""))


class NodePods:
    """A live view of the pods bound to ``node_name`` (see the module docstring)."""

    def __init__(
        self, kube: KubeApi, node_name: str, namespaces: Collection[str] | None = None
    ) -> None:
        """``namespaces``: watch only these (one watch each); ``None``: every namespace."""
        self._kube = kube
        self._node = node_name
        self._scopes: tuple[str | None, ...] = (
            (None,) if namespaces is None else tuple(sorted(set(namespaces)))
        )
        if not self._scopes:
            raise ValueError("NodePods needs at least one namespace to watch (or None for all)")
        self._pods: dict[tuple[str, str], KubeObject] = {}
        self._tick = asyncio.Event()
        """Set (and replaced) at every change: what waiters sleep on."""
        self._listeners: list[Listener] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._resource_versions: dict[str | None, str] = dict.fromkeys(self._scopes, "")
        self.synced_at: float | None = None
        """``time.monotonic()`` of the last successful list or event (the health probe)."""

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def get(self, namespace: str, name: str) -> KubeObject | None:
        return self._pods.get((namespace, name))

    def pods(self) -> list[KubeObject]:
        return list(self._pods.values())

    @property
    def started(self) -> bool:
        return bool(self._tasks)

    async def start(self) -> None:
        """List once (so the view is complete when this returns), then watch in the background."""
        if self._tasks:
            return
        for scope in self._scopes:
            await self._relist(scope)
        self._tasks = [
            asyncio.create_task(self._run(scope), name=f"watch pods on {self._node} in {scope}")
            for scope in self._scopes
        ]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def remember(self, pod: KubeObject) -> None:
        """Record a pod the agent itself just created or changed (its watch event may lag)."""
        key = pod_key(pod)
        if key not in self._pods or _newer(pod, self._pods[key]):
            self._pods[key] = pod
            self._wake()

    async def wait_for(self, check: Callable[[], _T | None], *, deadline: float) -> _T | None:
        """The first non-None ``check()`` after any change, or None at ``deadline``."""
        while True:
            tick = self._tick
            found = check()
            if found is not None:
                return found
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await tick.wait()

    def _wake(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    def _apply(self, kind: str, pod: KubeObject, scope: str | None) -> None:
        key = pod_key(pod)
        if kind == "DELETED":
            self._pods.pop(key, None)
        else:
            self._pods[key] = pod
        version = (pod.get("metadata") or {}).get("resourceVersion")
        if version:
            self._resource_versions[scope] = str(version)
        self.synced_at = time.monotonic()
        for listener in self._listeners:
            try:
                listener(kind, pod)
            except Exception:
                log.exception("pod listener failed on %s %s/%s", kind, *key)
        self._wake()

    async def _relist(self, scope: str | None) -> None:
        """List ``scope`` afresh; what the view held there and the list lacks is deleted."""
        pods, version = await self._kube.list_pods(scope, node_name=self._node)
        fresh = {pod_key(pod): pod for pod in pods}
        for key, pod in list(self._pods.items()):
            if key not in fresh and scope in (None, key[0]):
                self._apply("DELETED", pod, scope)
        for key, pod in fresh.items():
            old = self._pods.get(key)
            if old is None or old != pod:
                self._apply("ADDED" if old is None else "MODIFIED", pod, scope)
        self._resource_versions[scope] = version
        self.synced_at = time.monotonic()
        self._wake()

    async def _run(self, scope: str | None) -> None:
        where = "every namespace" if scope is None else f"namespace {scope}"
        relist = False
        while not self._stopping:
            try:
                if relist:
                    await self._relist(scope)
                relist = True
                async for event in self._kube.watch_pods(
                    scope,
                    node_name=self._node,
                    resource_version=self._resource_versions[scope],
                    deadline=time.monotonic() + _WATCH_SECONDS,
                ):
                    if self._stopping:
                        return
                    self._event(event, scope)
            except KubeError as e:
                log.warning(
                    "watching the pods of node %s in %s: %s; listing again", self._node, where, e
                )
                await asyncio.sleep(_RETRY_SECONDS)

    def _event(self, event: WatchEvent, scope: str | None) -> None:
        self._apply(event.type, event.object, scope)


def _newer(pod: KubeObject, than: KubeObject) -> bool:
    """Whether ``pod`` is a later version than ``than`` (resource versions are opaque but, on
    one object, increase as integers on etcd; unknown or equal: not newer)."""
    try:
        ours = int((pod.get("metadata") or {}).get("resourceVersion") or 0)
        theirs = int((than.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return False
    return ours > theirs
