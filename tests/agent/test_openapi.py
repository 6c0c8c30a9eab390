"""The shipped OpenAPI document: valid, complete about errors, and in agreement with the code.

The document is the contract the notebook side is written against, so it must not drift from
``errors.py`` (status and code of every error, their members), ``_structs.py`` (the payload
shapes) and ``validation.py`` (which requests are accepted).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from openapi_spec_validator import validate as validate_openapi
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from jupyter_gpu_hotplug import _structs
from jupyter_gpu_hotplug._structs import MAX_WAIT_SECONDS
from jupyter_gpu_hotplug.agent import openapi_document
from jupyter_gpu_hotplug.agent.api.validation import parse_attach_request
from jupyter_gpu_hotplug.agent.core.errors import (
    ERRORS_BY_CODE,
    AgentError,
    BodyTooLarge,
    InvalidRequest,
    Unavailable,
)

from .test_errors import CASES as ERROR_CASES
from .test_validation import (
    BAD_UUIDS,
    GOOD_UUIDS,
    INVALID_BODIES,
    VALID_BODIES,
    near_requests,
)

DOC: dict[str, Any] = json.loads(openapi_document())
BASE = "urn:gpu-hotplug-agent-openapi"
REGISTRY: Registry[Any] = Registry().with_resource(BASE, DRAFT202012.create_resource(DOC))
METHODS = {"get", "put", "post", "delete", "patch", "head", "options"}
ALL_CODES: set[_structs.ErrorCode] = set(get_args(_structs.ErrorCode))

# The error codes each operation can answer with (DESIGN §3, §4).
DETACH_ERRORS: set[_structs.ErrorCode] = {
    "invalid_request",
    "unauthenticated",
    "forbidden",
    "not_found",
    "busy",
    "target_not_ready",
    "timeout",
    "internal_error",
}
EXPECTED_ERRORS: dict[tuple[str, str], set[_structs.ErrorCode]] = {
    ("get", "/healthz"): {"internal_error"},
    ("get", "/readyz"): {"internal_error"},
    ("get", "/metrics"): {"unauthenticated", "forbidden", "internal_error"},
    ("get", "/v1/openapi.json"): {"unauthenticated", "forbidden", "internal_error"},
    ("get", "/v1/gpus"): {"unauthenticated", "internal_error"},
    ("get", "/v1/attachments"): {
        "invalid_request",
        "unauthenticated",
        "forbidden",
        "not_found",
        "internal_error",
    },
    ("post", "/v1/attachments"): ALL_CODES,
    ("delete", "/v1/attachments"): DETACH_ERRORS,
    ("delete", "/v1/attachments/{uuid}"): DETACH_ERRORS,
    ("get", "/v1/queue"): {
        "invalid_request",
        "unauthenticated",
        "forbidden",
        "not_found",
        "internal_error",
    },
    ("delete", "/v1/queue/{request_id}"): {
        "invalid_request",
        "unauthenticated",
        "forbidden",
        "not_found",
        "internal_error",
    },
    ("get", "/v1/idle-releases"): {
        "invalid_request",
        "unauthenticated",
        "forbidden",
        "not_found",
        "internal_error",
    },
}
UNAUTHENTICATED_PATHS = {"/healthz", "/readyz"}
"""The kubelet's probes carry no token; everything else is read by an authenticated caller
(issue 31: ``/metrics`` and this document are no anonymous client's business)."""


def validator(schema_name: str) -> Draft202012Validator:
    return Draft202012Validator(
        {"$ref": f"{BASE}#/components/schemas/{schema_name}"},
        registry=REGISTRY,
        format_checker=Draft202012Validator.FORMAT_CHECKER,
    )


def resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = REGISTRY.resolver(BASE).lookup(node["$ref"]).contents
    return node


def operations() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in DOC["paths"].items():
        for method, operation in item.items():
            if method in METHODS:
                yield method, path, operation


def error_schemas(response: dict[str, Any]) -> list[dict[str, Any]]:
    schema = resolve(response)["content"]["application/json"]["schema"]
    return [resolve(s) for s in schema.get("oneOf", [schema])]


def documented_errors(operation: dict[str, Any]) -> set[tuple[int, str]]:
    return {
        (int(status), schema["properties"]["error"]["const"])
        for status, response in operation["responses"].items()
        if int(status) >= 400
        for schema in error_schemas(response)
        if "error" in schema["properties"]  # not the probes' 503 (a Health body)
    }


def schema_for_code(code: str) -> str:
    names: list[str] = [
        name
        for name, schema in DOC["components"]["schemas"].items()
        if schema.get("properties", {}).get("error", {}).get("const") == code
    ]
    assert len(names) == 1, f"{code}: {names}"
    return names[0]


# --- the document itself -------------------------------------------------------------------------


def test_document_is_valid_openapi() -> None:
    validate_openapi(DOC)
    assert DOC["openapi"].startswith("3.1.")


def test_every_operation_is_expected() -> None:
    assert {(method, path) for method, path, _ in operations()} == set(EXPECTED_ERRORS)


@pytest.mark.parametrize(
    ("method", "path"), list(EXPECTED_ERRORS), ids=[f"{m} {p}" for m, p in EXPECTED_ERRORS]
)
def test_errors_documented_with_their_status(method: str, path: str) -> None:
    operation = DOC["paths"][path][method]
    expected = {(ERRORS_BY_CODE[code].status, code) for code in EXPECTED_ERRORS[(method, path)]}
    expected.add((BodyTooLarge.status, BodyTooLarge.code))  # any request may send a body
    expected.add((Unavailable.status, Unavailable.code))  # any connection may meet the caps
    assert documented_errors(operation) == expected


def test_every_error_class_is_documented_somewhere() -> None:
    documented = set().union(*(documented_errors(op) for _, _, op in operations()))
    classes: list[type[AgentError]] = [*ERRORS_BY_CODE.values(), BodyTooLarge, Unavailable]
    assert documented == {(cls.status, cls.code) for cls in classes}


@pytest.mark.parametrize(
    ("method", "path"), list(EXPECTED_ERRORS), ids=[f"{m} {p}" for m, p in EXPECTED_ERRORS]
)
def test_authentication(method: str, path: str) -> None:
    operation = DOC["paths"][path][method]
    if path in UNAUTHENTICATED_PATHS:
        assert operation["security"] == []
    else:
        assert "security" not in operation  # inherits the document's bearerAuth
    assert DOC["security"] == [{"bearerAuth": []}]
    assert DOC["components"]["securitySchemes"]["bearerAuth"] == {
        **DOC["components"]["securitySchemes"]["bearerAuth"],
        "type": "http",
        "scheme": "bearer",
    }


@pytest.mark.parametrize(
    "error", [case[1] for case in ERROR_CASES], ids=[case[0] for case in ERROR_CASES]
)
def test_error_bodies_match_their_schema(error: AgentError) -> None:
    body = error.to_body()
    errors = list(validator(schema_for_code(body["error"])).iter_errors(body))
    assert not errors, [e.message for e in errors]


# --- payload shapes agree with _structs ----------------------------------------------------------

SHAPES = [
    (_structs.GpuInfo, "GpuInfo"),
    (_structs.GpuList, "GpuList"),
    (_structs.Attachment, "Attachment"),
    (_structs.AttachmentList, "AttachmentList"),
    (_structs.SuspendedWire, "Suspended"),
    (_structs.AttachRequestBody, "AttachRequest"),
    (_structs.PodRefWire, "PodRef"),
    (_structs.PodTargetWire, "PodTarget"),
    (_structs.PidTargetWire, "PidTarget"),
    (_structs.ProcessInfo, "ProcessInfo"),
    (_structs.IdleReleaseWire, "Attachment/idle_release"),
    (_structs.IdleReleaseRecord, "IdleRelease"),
    (_structs.IdleReleaseList, "IdleReleaseList"),
    (_structs.QueuedRequest, "QueuedRequest"),
    (_structs.QueueView, "QueueView"),
]


@pytest.mark.parametrize(("typed_dict", "schema_name"), SHAPES, ids=[s[1] for s in SHAPES])
def test_typed_dicts_match_schemas(typed_dict: Any, schema_name: str) -> None:
    name, _, member = schema_name.partition("/")
    schema = DOC["components"]["schemas"][name]
    if member:
        schema = schema["properties"][member]
    assert set(schema["properties"]) == typed_dict.__required_keys__ | typed_dict.__optional_keys__
    assert set(schema["required"]) == typed_dict.__required_keys__
    assert schema["additionalProperties"] is False


def test_error_schemas_match_error_body() -> None:
    names = [schema_for_code(code) for code in ALL_CODES]
    members: set[str] = set()
    for name in names:
        schema = DOC["components"]["schemas"][name]
        assert _structs.ErrorBody.__required_keys__ <= set(schema["required"])
        assert schema["additionalProperties"] is False
        members |= set(schema["properties"])
    body_keys = _structs.ErrorBody.__required_keys__ | _structs.ErrorBody.__optional_keys__
    assert members == body_keys


def test_sample_payloads_validate() -> None:
    pod_target = _structs.PodTarget("jhub", "jupyter-a", "notebook").to_wire()
    gpus = _structs.GpuList(
        gpus=[
            _structs.GpuInfo(
                uuid=_structs.GpuUuid("GPU-0123abcd-4567-89ef-0123-456789abcdef"),
                index=0,
                minor=3,
                name="NVIDIA H100",
                memory_total=80 * 2**30,
                state="attached",
                target=pod_target,
                simulated=False,
                selectable=True,
                kind="gpu",
                plain_attach=True,
            ),
            _structs.GpuInfo(
                uuid=_structs.GpuUuid("MIG-0123abcd-4567-89ef-0123-456789abcdef"),
                index=1,
                minor=4,
                name="sim",
                memory_total=0,
                state="free",
                target=None,
                simulated=True,
                selectable=True,
                kind="mig_slice",
                plain_attach=False,
            ),
        ]
    )
    attachments = _structs.AttachmentList(
        attachments=[
            _structs.Attachment(
                uuid=_structs.GpuUuid("GPU-0123abcd-4567-89ef-0123-456789abcdef"),
                index=0,
                minor=3,
                name="NVIDIA H100",
                device="/dev/nvidia3",
                target=_structs.PidRef(77).to_wire(),
                holder=None,
                attached_at="2025-01-02T03:04:05Z",
            )
        ]
    )
    assert validator("GpuList").is_valid(gpus)
    assert validator("AttachmentList").is_valid(attachments)
    assert not validator("AttachmentList").is_valid(
        {"attachments": [{**attachments["attachments"][0], "attached_at": "yesterday"}]}
    )


# --- the request schema agrees with validation.py ------------------------------------------------

# Where validation.py is deliberately stricter than the schema can say, with the reason.
STRICTER_THAN_SCHEMA = {
    "count-too-many": "the maximum count is the agent's setting, not part of the contract",
    "count-float": "JSON Schema calls 1.0 an integer; the agent wants a JSON integer",
    "count-exponent": "1e0 is 1.0 to JSON Schema",
    "pid-float": "5.0 is an integer to JSON Schema",
    "request-id-newline": "Python's $ matches before a final newline; ECMA-262's does not",
    "gpus-fewer": "JSON Schema cannot say that gpus has count members (the document says it)",
    "gpus-more": "JSON Schema cannot say that gpus has count members (the document says it)",
}


def body_examples() -> list[tuple[str, object]]:
    """The validation tables' JSON objects; the rest (field ``body``, duplicate members) fail
    before any schema could apply."""
    examples = [(name, json.loads(raw)) for name, raw, _ in VALID_BODIES]
    examples += [
        (name, json.loads(raw))
        for name, raw, field, _ in INVALID_BODIES
        if field != "body" and not name.startswith("duplicate")
    ]
    return examples


def parser_accepts(value: object) -> bool:
    try:
        parse_attach_request(json.dumps(value).encode())
    except InvalidRequest:
        return False
    return True


@pytest.mark.parametrize(
    "value", [e[1] for e in body_examples()], ids=[e[0] for e in body_examples()]
)
def test_request_schema_agrees_with_validation(
    value: object, request: pytest.FixtureRequest
) -> None:
    name = request.node.callspec.id
    schema_accepts = validator("AttachRequest").is_valid(value)
    if name in STRICTER_THAN_SCHEMA:
        assert schema_accepts
        assert not parser_accepts(value)
    else:
        assert schema_accepts == parser_accepts(value)


def test_examples_cover_both_outcomes() -> None:
    outcomes = [parser_accepts(value) for _, value in body_examples()]
    assert outcomes.count(True) >= 5
    assert outcomes.count(False) >= 40


def has_known_divergence(value: object) -> bool:
    if isinstance(value, str):
        return value.endswith("\n")
    if isinstance(value, list):
        return any(has_known_divergence(v) for v in value)
    if isinstance(value, dict):
        return any(has_known_divergence(v) for v in value.values())
    return False


@settings(max_examples=500)
@given(near_requests)
def test_request_schema_agrees_on_generated_requests(value: object) -> None:
    text = json.dumps(value)
    if has_known_divergence(value) or "NaN" in text or "Infinity" in text:
        return
    assert validator("AttachRequest").is_valid(value) == parser_accepts(value)


def test_wait_limit_matches() -> None:
    schema = DOC["components"]["schemas"]["AttachRequest"]["properties"]["wait_seconds"]
    assert schema["maximum"] == MAX_WAIT_SECONDS
    assert schema["exclusiveMinimum"] == 0


@pytest.mark.parametrize(
    ("text", "valid"),
    [(u, True) for u in GOOD_UUIDS]
    + [(u, False) for name, u in BAD_UUIDS if name != "trailing-newline"],
)
def test_uuid_schema_agrees_with_validation(text: str, valid: bool) -> None:
    assert validator("GpuUuid").is_valid(text) is valid
