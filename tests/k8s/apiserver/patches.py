"""The three patch formats the official client sends, applied like the apiserver applies them.

``application/merge-patch+json`` (RFC 7386), ``application/json-patch+json`` (RFC 6902, the
client sends it for a list body) and ``application/strategic-merge-patch+json`` (the client's
choice for a dict body): a merge patch where lists that the Kubernetes schema marks with a
patch merge key are merged by that key instead of replaced, and ``$patch: delete`` /
``$patch: replace`` directives work. The merge keys are those of the fields a pod, an event and
their metadata have; other lists are replaced, as for a field without a merge strategy.
"""

from __future__ import annotations

import copy
from typing import Any, Final

from .errors import ApiError, bad_request

MERGE_PATCH: Final = "application/merge-patch+json"
JSON_PATCH: Final = "application/json-patch+json"
STRATEGIC_MERGE_PATCH: Final = "application/strategic-merge-patch+json"

MERGE_KEYS: Final = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "podIPs": "ip",
    "hostIPs": "ip",
    "readinessGates": "conditionType",
    "resourceClaims": "name",
}
"""Field name → patch merge key (``x-kubernetes-patch-merge-key`` in the real schema)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, field: str = "") -> Any:
    """A strategic merge patch (see the module docstring for what is covered)."""
    if isinstance(patch, list):
        key = MERGE_KEYS.get(field)
        if key is None or not isinstance(target, list):
            return copy.deepcopy(patch)
        return _merge_list(target, patch, key, field)
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if name.startswith("$"):
            continue
        if value is None:
            result.pop(name, None)
        else:
            result[name] = strategic_merge_patch(result.get(name), value, name)
    return result


def _merge_list(target: list[Any], patch: list[Any], key: str, field: str) -> list[Any]:
    result = [copy.deepcopy(item) for item in target]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise bad_request(f"map: {item!r} does not contain declared merge key: {key}")
        index = next((i for i, old in enumerate(result) if old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append({k: v for k, v in item.items() if k != "$patch"})
        else:
            result[index] = strategic_merge_patch(result[index], item, field)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(document: Any, parts: list[str]) -> Any:
    node = document
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 ``add``, ``remove``, ``replace``, ``test``, ``move``, ``copy``."""
    if not isinstance(operations, list):
        raise bad_request("json patch must be a list of operations")
    document = copy.deepcopy(target)
    for operation in operations:
        try:
            document = _apply(document, operation)
        except (KeyError, IndexError, ValueError, TypeError) as error:
            raise ApiError(
                422, "Invalid", f"the server rejected our request due to an error: {error!r}"
            ) from None
    return document


def _apply(document: Any, operation: dict[str, Any]) -> Any:
    op, parts = operation["op"], _pointer(operation["path"])
    if op == "test":
        if _get(document, parts) != operation["value"]:
            raise ValueError(f"test failed at {operation['path']}")
        return document
    if op in ("move", "copy"):
        value = copy.deepcopy(_get(document, _pointer(operation["from"])))
        if op == "move":
            document = _apply(document, {"op": "remove", "path": operation["from"]})
        return _apply(document, {"op": "add", "path": operation["path"], "value": value})
    if not parts:
        return copy.deepcopy(operation["value"]) if op != "remove" else None
    parent, last = _parent(document, parts), parts[-1]
    if op == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    elif op in ("add", "replace"):
        value = copy.deepcopy(operation["value"])
        if isinstance(parent, list):
            if last == "-":
                parent.append(value)
            elif op == "add":
                parent.insert(int(last), value)
            else:
                parent[int(last)] = value
        else:
            if op == "replace" and last not in parent:
                raise KeyError(last)
            parent[last] = value
    else:
        raise ValueError(f"unknown op {op!r}")
    return document


def _get(document: Any, parts: list[str]) -> Any:
    node = document
    for part in parts:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def apply_patch(content_type: str, target: Any, patch: Any) -> Any:
    """Apply ``patch`` of ``content_type``; 415 for a type the server does not take."""
    kind = content_type.split(";")[0].strip()
    if kind == MERGE_PATCH:
        return merge_patch(target, patch)
    if kind == STRATEGIC_MERGE_PATCH:
        return strategic_merge_patch(target, patch)
    if kind == JSON_PATCH:
        return json_patch(target, patch)
    raise ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: "
        f"{JSON_PATCH}, {MERGE_PATCH}, {STRATEGIC_MERGE_PATCH}",
    )
