"""The resources the fake serves, and the discovery documents the client may ask for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from .selectors import COMMON_FIELDS, EVENT_FIELDS, POD_FIELDS


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    verbs: tuple[str, ...] = (
        "create",
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "update",
        "watch",
    )
    subresources: tuple[str, ...] = ()
    fields: frozenset[str] = COMMON_FIELDS
    """Fields a field selector may name."""
    stored: bool = True
    """False for reviews: created, answered, never kept."""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()


_REVIEW_VERBS: Final = ("create",)

RESOURCES: Final = (
    Resource("", "v1", "namespaces", "Namespace", False, subresources=("status",)),
    Resource("", "v1", "nodes", "Node", False, subresources=("status",)),
    Resource("", "v1", "pods", "Pod", True, subresources=("status",), fields=POD_FIELDS),
    Resource("", "v1", "events", "Event", True, fields=EVENT_FIELDS),
    Resource("", "v1", "serviceaccounts", "ServiceAccount", True),
    Resource("events.k8s.io", "v1", "events", "Event", True),
    Resource("node.k8s.io", "v1", "runtimeclasses", "RuntimeClass", False),
    Resource("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False),
    Resource(
        "authentication.k8s.io",
        "v1",
        "tokenreviews",
        "TokenReview",
        False,
        verbs=_REVIEW_VERBS,
        stored=False,
    ),
    Resource(
        "authorization.k8s.io",
        "v1",
        "subjectaccessreviews",
        "SubjectAccessReview",
        False,
        verbs=_REVIEW_VERBS,
        stored=False,
    ),
)

BY_PATH: Final = {(r.group, r.version, r.plural): r for r in RESOURCES}
PODS: Final = BY_PATH[("", "v1", "pods")]
NAMESPACES: Final = BY_PATH[("", "v1", "namespaces")]
EVENTS: Final = BY_PATH[("", "v1", "events")]
NODES: Final = BY_PATH[("", "v1", "nodes")]
RUNTIME_CLASSES: Final = BY_PATH[("node.k8s.io", "v1", "runtimeclasses")]
PRIORITY_CLASSES: Final = BY_PATH[("scheduling.k8s.io", "v1", "priorityclasses")]
SERVICE_ACCOUNTS: Final = BY_PATH[("", "v1", "serviceaccounts")]

SERVER_VERSION: Final = {
    "major": "1",
    "minor": "34",
    "gitVersion": "v1.34.0-k8stier",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def _resource_entry(resource: Resource) -> list[dict[str, Any]]:
    entry = {
        "name": resource.plural,
        "singularName": resource.singular,
        "namespaced": resource.namespaced,
        "kind": resource.kind,
        "verbs": list(resource.verbs),
    }
    subs = [
        {
            "name": f"{resource.plural}/{sub}",
            "singularName": "",
            "namespaced": resource.namespaced,
            "kind": resource.kind,
            "verbs": ["get", "patch", "update"],
        }
        for sub in resource.subresources
    ]
    return [entry, *subs]


def resource_list(group: str, version: str) -> dict[str, Any] | None:
    """``APIResourceList`` of one group version, or ``None`` if it is not served."""
    served = [r for r in RESOURCES if (r.group, r.version) == (group, version)]
    if not served:
        return None
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": [entry for r in served for entry in _resource_entry(r)],
    }


def api_versions() -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
    }


def _group(name: str) -> dict[str, Any]:
    versions = sorted({r.version for r in RESOURCES if r.group == name})
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def api_group_list() -> dict[str, Any]:
    groups = sorted({r.group for r in RESOURCES if r.group})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group(g) for g in groups]}


def api_group(name: str) -> dict[str, Any] | None:
    if not any(r.group == name for r in RESOURCES):
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name)}
