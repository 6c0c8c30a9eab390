"""The apiserver's verbs with the behaviour of the real one's registry, admission and
controllers, over the ``Store``: names and generateName, namespaces, optimistic concurrency,
status subresources, graceful pod deletion, finalizers, the garbage collector and the two
review APIs.

Runs on the control plane's event loop only (see ``server.py``).
"""

from __future__ import annotations

import asyncio
import copy
import re
import secrets
from typing import Any, Final

from . import pods as podrules
from .errors import ApiError, bad_request, conflict, invalid, not_found
from .patches import apply_patch
from .resources import (
    NAMESPACES,
    PODS,
    PRIORITY_CLASSES,
    RESOURCES,
    RUNTIME_CLASSES,
    Resource,
)
from .reviews import Reviews
from .selectors import Predicate, field_selector, label_selector
from .store import Change, Store, now

_NAME: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NAME_CHARS: Final = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's generateName alphabet
INITIAL_NAMESPACES: Final = ("default", "kube-system", "kube-public", "kube-node-lease")


class Cluster:
    def __init__(self) -> None:
        self.store = Store()
        self.reviews = Reviews()
        self._orphaned: set[str] = set()
        """Uids of owners deleted with propagationPolicy Orphan."""
        self.store.on_change(self._controllers)
        for name in INITIAL_NAMESPACES:
            self.create(NAMESPACES, "", {"metadata": {"name": name}})

    # ----- verbs ------------------------------------------------------------------------

    def create(self, resource: Resource, namespace: str, body: Any) -> dict[str, Any]:
        obj = self._object_body(resource, body)
        if not resource.stored:
            return self._review(resource, obj)
        meta = obj.setdefault("metadata", {})
        if resource.namespaced:
            if meta.get("namespace", namespace) != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request"
                )
            meta["namespace"] = namespace
            self._namespace_accepts(namespace)
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(
                    resource.kind,
                    "",
                    [("metadata.name", "Required value: name or generateName is required")],
                )
            suffix = "".join(secrets.choice(_NAME_CHARS) for _ in range(5))
            meta["name"] = meta["generateName"] + suffix
        if len(meta["name"]) > 253 or not _NAME.match(meta["name"]):
            raise invalid(
                resource.kind,
                meta["name"],
                [
                    (
                        "metadata.name",
                        f'Invalid value: "{meta["name"]}": a lowercase RFC 1123 subdomain '
                        "must consist of lower case alphanumeric characters, '-' or '.', and "
                        "must start and end with an alphanumeric character",
                    )
                ],
            )
        self._admit_create(resource, obj)
        created = self.store.create(resource, obj)
        if resource == PODS and created["metadata"].get("ownerReferences"):
            asyncio.get_running_loop().call_soon(self._collect_orphan, created)
        return created

    def read(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        return self.store.get(resource, namespace, name)

    def list(
        self, resource: Resource, namespace: str, labels: str | None, fields: str | None
    ) -> dict[str, Any]:
        matches = self.selector(resource, labels, fields)
        items = [o for o in self.store.list(resource, namespace) if matches(o)]
        for item in items:  # items of a list carry no kind/apiVersion of their own
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": {"resourceVersion": str(self.store.revision)},
            "items": items,
        }

    def selector(self, resource: Resource, labels: str | None, fields: str | None) -> Predicate:
        by_label, by_field = label_selector(labels), field_selector(fields, resource.fields)
        return lambda obj: by_label(obj) and by_field(obj)

    def replace(
        self, resource: Resource, namespace: str, name: str, body: Any, subresource: str = ""
    ) -> dict[str, Any]:
        new = self._object_body(resource, body)
        meta = new.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise bad_request("the name of the object does not match the name on the URL")
        current = self.store.get(resource, namespace, name)
        wanted_version = meta.get("resourceVersion")
        if wanted_version and wanted_version != current["metadata"]["resourceVersion"]:
            raise conflict(
                f"{resource.plural}.{resource.group}" if resource.group else resource.plural,
                name,
                "the object has been modified; please apply your changes to the latest "
                "version and try again",
            )
        return self._write(resource, current, new, subresource)

    def patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str = "",
    ) -> dict[str, Any]:
        current = self.store.get(resource, namespace, name)
        new = apply_patch(content_type, current, patch)
        if not isinstance(new, dict):
            raise bad_request("the patch does not produce an object")
        wanted = new.get("metadata", {}).get("resourceVersion")
        if wanted != current["metadata"]["resourceVersion"]:
            raise conflict(
                resource.plural,
                name,
                "the object has been modified; please apply your changes to the latest "
                "version and try again",
            )
        return self._write(resource, current, new, subresource)

    def delete(
        self, resource: Resource, namespace: str, name: str, options: dict[str, Any]
    ) -> dict[str, Any]:
        current = self.store.get(resource, namespace, name)
        meta = current["metadata"]
        preconditions = options.get("preconditions") or {}
        for key in ("uid", "resourceVersion"):
            if preconditions.get(key) and preconditions[key] != meta[key]:
                raise conflict(
                    resource.plural,
                    name,
                    f"Precondition failed: {key.upper() if key == 'uid' else key} in "
                    f"precondition: {preconditions[key]}, {key.upper() if key == 'uid' else key}"
                    f" in object meta: {meta[key]}",
                )
        orphan = options.get("propagationPolicy") == "Orphan" or options.get("orphanDependents")
        if orphan:
            self._orphaned.add(meta["uid"])
        if resource == PODS:
            return self._delete_pod(current, options.get("gracePeriodSeconds"))
        if resource == NAMESPACES:
            return self._delete_namespace(current)
        return self._finalize(resource, current)

    # ----- the pieces -------------------------------------------------------------------

    def _object_body(self, resource: Resource, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request(f"the body of the request is not a {resource.kind} object")
        kind = body.get("kind")
        if kind is not None and kind != resource.kind:
            raise bad_request(f"the body is a {kind}, not a {resource.kind}")
        obj = copy.deepcopy(body)
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        return obj

    def _namespace_accepts(self, namespace: str) -> None:
        found = self.store.find(NAMESPACES, "", namespace)
        if found is None:
            raise not_found("namespaces", namespace)
        if found.get("status", {}).get("phase") == "Terminating":
            raise ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace {namespace} because it is being "
                "terminated",
            )

    def _admit_create(self, resource: Resource, obj: dict[str, Any]) -> None:
        if resource == NAMESPACES:
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj[
                "metadata"
            ]["name"]
        elif resource == PODS:
            priorities = {
                pc["metadata"]["name"]: int(pc.get("value", 0))
                for pc in self.store.list(PRIORITY_CLASSES)
            }
            if obj.get("spec", {}).get("priorityClassName") not in (None, *priorities):
                raise forbidden_priority(obj)
            podrules.default_pod(obj, priorities)
            podrules.validate_pod(obj)
        elif resource == RUNTIME_CLASSES and not obj.get("handler"):
            raise invalid("RuntimeClass", obj["metadata"]["name"], [("handler", "Required value")])
        elif resource.kind == "Event" and resource.group == "":
            _validate_event(obj)

    def _write(
        self, resource: Resource, current: dict[str, Any], new: dict[str, Any], subresource: str
    ) -> dict[str, Any]:
        """Apply an update (main resource or ``status``) with the real strategy's rules."""
        if subresource and subresource not in resource.subresources:
            raise not_found(f"{resource.plural}/{subresource}", current["metadata"]["name"])
        merged = copy.deepcopy(current)
        if subresource == "status":
            merged["status"] = new.get("status", {})
        else:
            meta = new.get("metadata") or {}
            for key in ("labels", "annotations", "ownerReferences", "finalizers"):
                if key in meta:
                    merged["metadata"][key] = meta[key]
                else:
                    merged["metadata"].pop(key, None)
            for key, value in new.items():
                if key not in ("metadata", "status", "apiVersion", "kind"):
                    merged[key] = value
            if resource == PODS:
                podrules.validate_pod_update(current, merged)
            if "status" not in resource.subresources and "status" in new:
                merged["status"] = new["status"]  # no status subresource: status is plain data
        written = self.store.update(resource, merged)
        meta = written["metadata"]
        finished = resource != PODS or written.get("status", {}).get("phase") in podrules.TERMINAL
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and finished:
            return self._finalize(resource, written)
        return written

    def _delete_pod(self, pod: dict[str, Any], grace: int | None) -> dict[str, Any]:
        """Graceful deletion: a pod bound to a node and still running is only marked; the
        kubelet stops it and deletes it again with grace 0 (``kubelet.py``)."""
        meta = pod["metadata"]
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        running = pod.get("status", {}).get("phase") not in podrules.TERMINAL
        if pod["spec"].get("nodeName") and running and grace > 0:
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now()
                meta["deletionGracePeriodSeconds"] = grace
                return self.store.update(PODS, pod)
            return pod
        return self._finalize(PODS, pod)

    def _delete_namespace(self, namespace: dict[str, Any]) -> dict[str, Any]:
        name = namespace["metadata"]["name"]
        if not namespace["metadata"].get("deletionTimestamp"):
            namespace["metadata"]["deletionTimestamp"] = now()
            namespace["status"] = {"phase": "Terminating"}
            namespace = self.store.update(NAMESPACES, namespace)
        for resource in RESOURCES:
            if resource.namespaced and resource.stored:
                for obj in self.store.list(resource, name):
                    if not obj["metadata"].get("deletionTimestamp"):
                        self.delete(resource, name, obj["metadata"]["name"], {})
        self._remove_namespace_if_empty(name)
        return namespace

    def _remove_namespace_if_empty(self, name: str) -> None:
        found = self.store.find(NAMESPACES, "", name)
        if found is None or found.get("status", {}).get("phase") != "Terminating":
            return
        if any(self.store.list(r, name) for r in RESOURCES if r.namespaced and r.stored):
            return
        self.store.remove(NAMESPACES, "", name)

    def _finalize(self, resource: Resource, obj: dict[str, Any]) -> dict[str, Any]:
        """Remove the object, or mark it for deletion while finalizers remain."""
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now()
                meta["deletionGracePeriodSeconds"] = 0
                return self.store.update(resource, obj)
            return obj
        return self.store.remove(resource, meta.get("namespace", ""), meta["name"])

    # ----- controllers (run after every change) -----------------------------------------

    def _controllers(self, change: Change) -> None:
        namespace = change.object["metadata"].get("namespace", "")
        if change.type == "DELETED":
            loop = asyncio.get_running_loop()
            loop.call_soon(self._collect_dependents, change.object)
            if namespace:
                loop.call_soon(self._remove_namespace_if_empty, namespace)

    def _collect_dependents(self, owner: dict[str, Any]) -> None:
        """The garbage collector, background propagation: dependents of a removed owner
        (same namespace, or any namespace for a cluster-scoped owner) are deleted, or
        orphaned (the reference removed) when the owner was deleted with Orphan."""
        uid = owner["metadata"]["uid"]
        namespace = owner["metadata"].get("namespace", "")
        orphan = uid in self._orphaned
        self._orphaned.discard(uid)
        for pod in self.store.list(PODS, namespace):
            refs = pod["metadata"].get("ownerReferences") or []
            if not any(ref.get("uid") == uid for ref in refs):
                continue
            remaining = [ref for ref in refs if ref.get("uid") != uid]
            if orphan or remaining:
                pod["metadata"]["ownerReferences"] = remaining
                self.store.update(PODS, pod)
            elif not pod["metadata"].get("deletionTimestamp"):
                self.delete(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], {})

    def _collect_orphan(self, pod: dict[str, Any]) -> None:
        """A dependent whose owners do not exist (in its own namespace, for a namespaced
        owner kind; the garbage collector never looks across namespaces) is deleted."""
        current = self.store.find(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"])
        if current is None or current["metadata"]["uid"] != pod["metadata"]["uid"]:
            return
        refs = current["metadata"].get("ownerReferences") or []
        if refs and not any(self._owner_exists(ref, current) for ref in refs):
            self.delete(PODS, current["metadata"]["namespace"], current["metadata"]["name"], {})

    def _owner_exists(self, ref: dict[str, Any], dependent: dict[str, Any]) -> bool:
        for resource in RESOURCES:
            if resource.kind != ref.get("kind") or resource.api_version != ref.get("apiVersion"):
                continue
            namespace = dependent["metadata"]["namespace"] if resource.namespaced else ""
            found = self.store.find(resource, namespace, ref.get("name", ""))
            return found is not None and found["metadata"]["uid"] == ref.get("uid")
        return True  # a kind this fake does not serve: assume its owner exists

    # ----- reviews ----------------------------------------------------------------------

    def _review(self, resource: Resource, body: dict[str, Any]) -> dict[str, Any]:
        if resource.kind == "TokenReview":
            return self.reviews.token_review(body, lambda ns, name: self.store.find(PODS, ns, name))
        return self.reviews.access_review(body)


def _validate_event(event: dict[str, Any]) -> None:
    """The core/v1 Event rules an agent can break: an involved object, in the event's own
    namespace when it names one."""
    meta, involved = event["metadata"], event.get("involvedObject")
    if not isinstance(involved, dict):
        raise invalid("Event", meta["name"], [("involvedObject", "Required value")])
    if involved.get("namespace") and involved["namespace"] != meta["namespace"]:
        raise invalid(
            "Event",
            meta["name"],
            [
                (
                    "involvedObject.namespace",
                    f'Invalid value: "{involved["namespace"]}": does not match event.namespace',
                )
            ],
        )


def forbidden_priority(pod: dict[str, Any]) -> ApiError:
    name = pod["spec"]["priorityClassName"]
    return ApiError(
        403,
        "Forbidden",
        f'pods "{pod["metadata"].get("name", "")}" is forbidden: no PriorityClass with name '
        f"{name} was found",
    )
