"""Label and field selectors, parsed and evaluated as the apiserver does.

Label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``, ``a``, ``!a``,
comma-joined (AND). Field selectors: ``path=value``, ``path==value``, ``path!=value`` on the
fields the real server allows for the resource (for pods: ``metadata.name``,
``metadata.namespace``, ``spec.nodeName``, ``spec.restartPolicy``, ``spec.schedulerName``,
``spec.serviceAccountName``, ``status.phase``, ``status.podIP``); other fields are a 400, as
there.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from .errors import bad_request

Predicate = Callable[[Mapping[str, Any]], bool]

_SET_TERM: Final = re.compile(r"^\s*(!?)\s*([\w./-]+)\s*(?:(in|notin)\s*\(([^)]*)\))?\s*$")
_EQ_TERM: Final = re.compile(r"^\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$")

COMMON_FIELDS: Final = frozenset({"metadata.name", "metadata.namespace"})
POD_FIELDS: Final = COMMON_FIELDS | {
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
}
EVENT_FIELDS: Final = COMMON_FIELDS | {
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
}


def _split_terms(text: str) -> list[str]:
    """Split at commas outside parentheses."""
    terms, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [t for t in terms if t.strip()]


@dataclass(frozen=True)
class _Requirement:
    key: str
    op: str
    """``=``, ``!=``, ``in``, ``notin``, ``exists`` or ``!`` (does not exist)."""
    values: frozenset[str] = frozenset()

    def holds(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.op == "exists":
            return value is not None
        if self.op == "!":
            return value is None
        if self.op in ("=", "in"):
            return value in self.values
        return value not in self.values  # "!=" and "notin" also match an absent label


def _label_requirement(term: str) -> _Requirement:
    if eq := _EQ_TERM.match(term):
        key, op, value = eq.groups()
        return _Requirement(key, "!=" if op == "!=" else "=", frozenset({value}))
    if st := _SET_TERM.match(term):
        negate, key, op, values = st.groups()
        if op and negate:
            raise bad_request(f"unable to parse requirement: {term!r}")
        choices = frozenset(v.strip() for v in (values or "").split(",") if v.strip())
        return _Requirement(key, op or ("!" if negate else "exists"), choices)
    raise bad_request(f"unable to parse requirement: {term!r}")


def label_selector(text: str | None) -> Predicate:
    """A predicate over an object's ``metadata.labels``; 400 on a malformed selector."""
    requirements = [_label_requirement(term) for term in _split_terms(text or "")]

    def matches(obj: Mapping[str, Any]) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(r.holds(labels) for r in requirements)

    return matches


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The selectable value of ``path`` (missing → ``""``, as the apiserver's field sets)."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def field_selector(text: str | None, allowed: frozenset[str]) -> Predicate:
    """A predicate over the fields ``allowed`` for this resource; 400 for any other field."""
    requirements = []
    for term in _split_terms(text or ""):
        eq = _EQ_TERM.match(term)
        if not eq:
            raise bad_request(f"invalid selector: {term!r}")
        path, op, value = eq.groups()
        if path not in allowed:
            raise bad_request(f"field label not supported: {path}")
        requirements.append(_Requirement(path, "!=" if op == "!=" else "=", frozenset({value})))

    def matches(obj: Mapping[str, Any]) -> bool:
        return all(r.holds({r.key: field_value(obj, r.key)}) for r in requirements)

    return matches
