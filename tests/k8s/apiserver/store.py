"""The objects, their resource versions and the watch streams: the fake's etcd.

One global, strictly increasing resource version (like etcd's revision) stamps every change.
Every change is kept in a history, so a watch that starts at a list's resourceVersion misses
nothing in between (as the watch cache guarantees); ``compact()`` drops the history, after
which such a watch gets ``410 Gone`` ("too old resource version"), like after etcd compaction.

Single-threaded by design: everything here runs on the control plane's event loop.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ApiError, already_exists, not_found
from .resources import Resource

EventType = Literal["ADDED", "MODIFIED", "DELETED"]
Key = tuple[Resource, str, str]
"""(resource, namespace or "", name)."""


def now() -> str:
    """A timestamp as the apiserver writes one (RFC 3339, seconds, UTC)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Change:
    type: EventType
    resource: Resource
    object: dict[str, Any]
    old: dict[str, Any] | None
    """The object before a MODIFIED (what selector transitions compare with)."""
    revision: int


def _without_version(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
    return obj | {"metadata": meta}


class Watcher:
    """One watch stream: the changes of one resource, optionally in one namespace."""

    def __init__(self, resource: Resource, namespace: str) -> None:
        self.resource = resource
        self.namespace = namespace
        self.queue: asyncio.Queue[Change | None] = asyncio.Queue()

    def wants(self, change: Change) -> bool:
        if change.resource != self.resource:
            return False
        return not self.namespace or change.object["metadata"].get("namespace") == self.namespace


class Store:
    def __init__(self) -> None:
        self.revision = 1
        self._objects: dict[Key, dict[str, Any]] = {}
        self._history: list[Change] = []
        self._compacted = 0
        self._watchers: set[Watcher] = set()
        self._on_change: list[Callable[[Change], None]] = []

    # ----- reading ----------------------------------------------------------------------

    def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        """A copy of the object; 404 if absent."""
        found = self._objects.get((resource, namespace, name))
        if found is None:
            raise not_found(resource.plural, name, resource.group)
        return copy.deepcopy(found)

    def find(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        found = self._objects.get((resource, namespace, name))
        return None if found is None else copy.deepcopy(found)

    def list(self, resource: Resource, namespace: str = "") -> list[dict[str, Any]]:
        """Copies of the objects of ``resource`` (in ``namespace``, or all), in name order."""
        return [copy.deepcopy(obj) for obj in self._iter(resource, namespace)]

    def _iter(self, resource: Resource, namespace: str) -> Iterator[dict[str, Any]]:
        for (res, ns, _), obj in sorted(self._objects.items(), key=lambda kv: kv[0][1:]):
            if res == resource and (not namespace or ns == namespace):
                yield obj

    # ----- writing ----------------------------------------------------------------------

    def create(self, resource: Resource, obj: dict[str, Any]) -> dict[str, Any]:
        """Store a new object; sets uid, resourceVersion, creationTimestamp, generation."""
        meta = obj["metadata"]
        key = (resource, meta.get("namespace", ""), meta["name"])
        if key in self._objects:
            raise already_exists(resource.plural, meta["name"])
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        meta["generation"] = 1
        for server_set in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
            meta.pop(server_set, None)
        return self._commit("ADDED", resource, key, obj, None)

    def update(self, resource: Resource, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace an existing object with ``obj`` (identity fields kept from the stored one)."""
        meta = obj["metadata"]
        key = (resource, meta.get("namespace", ""), meta["name"])
        old = self._objects.get(key)
        if old is None:
            raise not_found(resource.plural, meta["name"], resource.group)
        for kept in ("uid", "creationTimestamp", "generation"):
            meta[kept] = old["metadata"][kept]
        if obj.get("spec") != old.get("spec"):
            meta["generation"] = old["metadata"]["generation"] + 1
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        if _without_version(obj) == _without_version(old):
            return copy.deepcopy(old)  # no change: no new revision, no event (as the apiserver)
        return self._commit("MODIFIED", resource, key, obj, old)

    def remove(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        """Remove the object for good (the DELETED event carries its last state)."""
        key = (resource, namespace, name)
        old = self._objects.pop(key, None)
        if old is None:
            raise not_found(resource.plural, name, resource.group)
        self.revision += 1
        final = copy.deepcopy(old)
        final["metadata"]["resourceVersion"] = str(self.revision)
        self._publish(Change("DELETED", resource, final, old, self.revision))
        return copy.deepcopy(final)

    def _commit(
        self,
        kind: EventType,
        resource: Resource,
        key: Key,
        obj: dict[str, Any],
        old: dict[str, Any] | None,
    ) -> dict[str, Any]:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        self._objects[key] = copy.deepcopy(obj)
        self._publish(Change(kind, resource, copy.deepcopy(obj), old, self.revision))
        return copy.deepcopy(obj)

    # ----- watching ---------------------------------------------------------------------

    def on_change(self, callback: Callable[[Change], None]) -> None:
        """Call ``callback`` synchronously after every change (controllers: GC, kubelet)."""
        self._on_change.append(callback)

    def _publish(self, change: Change) -> None:
        self._history.append(change)
        for watcher in list(self._watchers):
            if watcher.wants(change):
                watcher.queue.put_nowait(change)
        for callback in list(self._on_change):
            callback(change)

    def watch(self, resource: Resource, namespace: str, since: int | None) -> Watcher:
        """A watcher that first gets every change after revision ``since`` (``None``: none),
        then every new one; 410 Gone if ``since`` is older than the kept history."""
        if since is not None and since < self._compacted:
            raise ApiError(410, "Expired", f"too old resource version: {since} ({self._compacted})")
        watcher = Watcher(resource, namespace)
        if since is not None:
            for change in self._history:
                if change.revision > since and watcher.wants(change):
                    watcher.queue.put_nowait(change)
        self._watchers.add(watcher)
        return watcher

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close_watches(self) -> None:
        """End every watch stream (the server is stopping)."""
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(None)
        self._watchers.clear()

    def compact(self) -> None:
        """Forget the history: watches from an older resourceVersion now get 410 Gone."""
        self._history.clear()
        self._compacted = self.revision
