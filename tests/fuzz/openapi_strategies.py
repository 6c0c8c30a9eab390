"""Hypothesis strategies generated from ``openapi.json``: valid values of each schema, and
requests of each documented operation, mutated towards the hostile.

Why our own generator: the document uses a small subset of JSON Schema (``$ref``, ``oneOf``,
``anyOf``, ``const``, ``enum``, objects with ``required`` and ``additionalProperties: false``,
bounded integers and numbers, patterned strings, arrays), and ``hypothesis-jsonschema`` does
not run with the Hypothesis this project pins. Every value comes from the document, so a new
field or route in it is fuzzed without touching the tests.

``mutated`` wraps a valid value's strategy: most draws stay valid (to reach deep code), the
rest swap a leaf for something hostile — a huge or negative number, a float for an integer,
unicode, a path, CRLF or NUL in a string, a wrong type, an unknown member, a missing one.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

JSON = Any

HOSTILE_STRINGS = st.sampled_from(
    [
        "",
        "../../etc/passwd",
        "/var/lib/gpu-hotplug/token",
        "..%2F..%2Fhealthz",
        "a\r\nX-Injected: 1",
        "nul\x00byte",
        "\u202eevil\u2066",
        "\U0001f680" * 40,
        "\uff47\uff50\uff55",  # fullwidth "gpu"
        "GPU-00000000-0000-4000-8000-00000000000G",
        "x" * 5000,
        "%00",
        "${jndi:ldap://x}",
        "'; DROP TABLE attachments; --",
    ]
)
HOSTILE_NUMBERS = st.sampled_from(
    [0, -1, 1.5, 1e308, -(2**63), 2**63, 2**64 + 1, 10**300, 4194304, 4194303, 1.0, -0.0]
)
HOSTILE_VALUES: st.SearchStrategy[JSON] = st.one_of(
    HOSTILE_STRINGS,
    HOSTILE_NUMBERS,
    st.sampled_from([None, True, False, [], {}, [[]], {"": {}}]),
)


@dataclass(frozen=True)
class Document:
    """An OpenAPI document and the strategies made from it."""

    doc: Mapping[str, JSON]

    def resolve(self, node: Mapping[str, JSON]) -> Mapping[str, JSON]:
        while "$ref" in node:
            target: JSON = self.doc
            for part in node["$ref"].removeprefix("#/").split("/"):
                target = target[part]
            node = target
        return node

    def values(self, schema: Mapping[str, JSON]) -> st.SearchStrategy[JSON]:
        """Values valid for ``schema``."""
        schema = self.resolve(schema)
        for keyword in ("oneOf", "anyOf"):
            if keyword in schema:
                return st.one_of([self.values(s) for s in schema[keyword]])
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.values({**schema, "type": k}) for k in kind])
        maker = _MAKERS.get(kind)
        if maker is None:
            raise NotImplementedError(f"schema keyword set not supported: {sorted(schema)}")
        return maker(self, schema)

    def mutated(self, schema: Mapping[str, JSON]) -> st.SearchStrategy[JSON]:
        """Mostly valid values of ``schema``, some with a hostile leaf or member."""
        schema = self.resolve(schema)
        hostile: list[st.SearchStrategy[JSON]] = [HOSTILE_VALUES]
        if schema.get("type") == "object" and "properties" in schema:
            members = sorted(schema["properties"])
            hostile.append(
                st.tuples(self.values(schema), st.sampled_from(members), HOSTILE_VALUES).map(
                    lambda t: {**t[0], t[1]: t[2]}
                )
            )
            hostile.append(
                st.tuples(self.values(schema), st.text(max_size=12), HOSTILE_VALUES).map(
                    lambda t: {**t[0], t[1]: t[2]}
                )
            )
            hostile.append(
                st.tuples(self.values(schema), st.sampled_from(members)).map(
                    lambda t: {k: v for k, v in t[0].items() if k != t[1]}
                )
            )
            for name, member in schema["properties"].items():
                hostile.append(
                    st.tuples(self.values(schema), self.mutated(member)).map(_setter(name))
                )
        # Three draws in four stay valid, so that requests reach past validation.
        return st.integers(0, 3).flatmap(
            lambda k: self.values(schema) if k else st.one_of(*hostile)
        )

    def operations(self) -> list[tuple[str, str, Mapping[str, JSON]]]:
        return [
            (method.upper(), path, operation)
            for path, item in self.doc["paths"].items()
            for method, operation in item.items()
            if method in ("get", "post", "put", "patch", "delete")
        ]

    def request(
        self, *, fix_value: Callable[[str, JSON], JSON] = lambda name, value: value
    ) -> st.SearchStrategy[tuple[str, str, bytes | None]]:
        """``(method, path with query, body)`` of a documented operation, mutated.

        ``fix_value(name, value)`` may replace a generated parameter or body member (e.g. a
        pid that could name someone else's process on the test host).
        """
        return st.one_of([self._request(*op, fix_value) for op in self.operations()])

    def _request(
        self,
        method: str,
        path: str,
        operation: Mapping[str, JSON],
        fix_value: Callable[[str, JSON], JSON],
    ) -> st.SearchStrategy[tuple[str, str, bytes | None]]:
        parameters = [self.resolve(p) for p in operation.get("parameters", [])]
        path_params = [p for p in parameters if p["in"] == "path"]
        query_params = [p for p in parameters if p["in"] == "query"]

        @st.composite
        def build(draw: st.DrawFn) -> tuple[str, str, bytes | None]:
            filled = path
            for param in path_params:
                value = fix_value(param["name"], draw(self.mutated(param["schema"])))
                filled = filled.replace(
                    "{" + param["name"] + "}", urllib.parse.quote(_text(value), safe="")
                )
            query: list[tuple[str, str]] = []
            for param in query_params:
                if draw(st.booleans()):
                    value = fix_value(param["name"], draw(self.mutated(param["schema"])))
                    query.append((param["name"], _text(value)))
            if draw(st.integers(0, 9)) == 0:  # a parameter the operation does not know
                query.append((draw(st.text(max_size=8)), draw(st.text(max_size=8))))
            body: bytes | None = None
            if "requestBody" in operation:
                schema = operation["requestBody"]["content"]["application/json"]["schema"]
                value = _fix_members(draw(self.mutated(schema)), fix_value)
                body = _dumps(value)
            elif draw(st.integers(0, 9)) == 0:
                body = draw(st.binary(max_size=64))
            target = filled + ("?" + urllib.parse.urlencode(query) if query else "")
            return method, target, body

        return build()


def _setter(name: str) -> Callable[[tuple[JSON, JSON]], JSON]:
    def put(pair: tuple[JSON, JSON]) -> JSON:
        return {**pair[0], name: pair[1]}

    return put


def _object(doc: Document, schema: Mapping[str, JSON]) -> st.SearchStrategy[JSON]:
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries(
        {name: doc.values(s) for name, s in properties.items() if name in required},
        optional={name: doc.values(s) for name, s in properties.items() if name not in required},
    )


def _integer(doc: Document, schema: Mapping[str, JSON]) -> st.SearchStrategy[JSON]:
    low, high = schema.get("minimum"), schema.get("maximum")
    anywhere = st.integers(min_value=low, max_value=high)
    if low is None or (high is not None and high - low <= 16):
        return anywhere
    # Small values near the minimum too: counts, indexes (an unbounded draw is rarely one).
    return st.one_of(st.integers(low, low + 8 if high is None else min(high, low + 8)), anywhere)


def _number(doc: Document, schema: Mapping[str, JSON]) -> st.SearchStrategy[JSON]:
    low = schema.get("exclusiveMinimum", schema.get("minimum"))
    return st.floats(
        min_value=low,
        max_value=schema.get("maximum"),
        exclude_min="exclusiveMinimum" in schema,
        allow_nan=False,
        allow_infinity=False,
    )


def _string(doc: Document, schema: Mapping[str, JSON]) -> st.SearchStrategy[JSON]:
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if "pattern" in schema:
        strings = st.from_regex(re.compile(schema["pattern"]), fullmatch=True)
    else:
        strings = st.text(max_size=high if high is not None else 64)
    return strings.filter(lambda s: low <= len(s) and (high is None or len(s) <= high))


def _array(doc: Document, schema: Mapping[str, JSON]) -> st.SearchStrategy[JSON]:
    return st.lists(doc.values(schema.get("items", {"type": "string"})), max_size=3)


_MAKERS: Mapping[str | None, Callable[[Document, Mapping[str, JSON]], st.SearchStrategy[JSON]]] = {
    "object": _object,
    "integer": _integer,
    "number": _number,
    "string": _string,
    "array": _array,
    "boolean": lambda doc, schema: st.booleans(),
    "null": lambda doc, schema: st.none(),
}


def _text(value: JSON) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return _dumps(value).decode()


def _dumps(value: JSON) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    except ValueError:  # an int beyond the str conversion limit: hostile enough as text
        return b'{"count": 1' + b"0" * 5000 + b"}"


def _fix_members(value: JSON, fix_value: Callable[[str, JSON], JSON]) -> JSON:
    if isinstance(value, dict):
        return {k: fix_value(k, _fix_members(v, fix_value)) for k, v in value.items()}
    if isinstance(value, list):
        return [_fix_members(v, fix_value) for v in value]
    return value
