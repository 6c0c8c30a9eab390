"""The client's error hierarchy mirrors the agent's, and error answers map to it exactly.

The client may not import the agent package; these tests may, and they check that the two
hierarchies agree on codes, statuses and default ``retryable``, so neither can drift alone.
"""

from __future__ import annotations

import json
from typing import get_args

import pytest

from jupyter_gpu_hotplug._structs import ErrorCode, GpuUuid
from jupyter_gpu_hotplug.agent.core import errors as agent_errors
from jupyter_gpu_hotplug.client import errors
from jupyter_gpu_hotplug.client.errors import (
    ERRORS_BY_CODE,
    AgentClientError,
    AgentError,
    AgentInternalError,
    AgentTimeout,
    Busy,
    BusyProcess,
    Forbidden,
    InvalidRequest,
    NotFound,
    TargetNotReady,
    Unauthenticated,
    error_from_response,
)
from tests.agent.test_errors import CASES as AGENT_CASES

URL = "unix:/run/gpu-hotplug/agent.sock"


def _map(status: int, body: bytes, *, missing_token: str | None = None) -> AgentError:
    return error_from_response(
        status, "Reason", body, agent_url=URL, operation="attach 1 GPU", missing_token=missing_token
    )


def test_one_class_per_code_like_the_agent() -> None:
    assert set(ERRORS_BY_CODE) == set(get_args(ErrorCode)) == set(agent_errors.ERRORS_BY_CODE)
    for code, cls in ERRORS_BY_CODE.items():
        agent_cls = agent_errors.ERRORS_BY_CODE[code]
        assert (
            agent_cls.code,
            agent_cls.status,
            agent_cls.default_retryable,
        ) == (cls.CODE, cls.STATUS, cls.DEFAULT_RETRYABLE)


def test_everything_is_an_agent_client_error() -> None:
    public = [getattr(errors, name) for name in errors.__all__]
    classes = [obj for obj in public if isinstance(obj, type) and issubclass(obj, Exception)]
    assert len(classes) == 15
    assert all(issubclass(cls, AgentClientError) for cls in classes)


@pytest.mark.parametrize(
    "agent_error", [case[1] for case in AGENT_CASES], ids=[case[0] for case in AGENT_CASES]
)
def test_maps_every_agent_error(agent_error: agent_errors.AgentError) -> None:
    body = agent_error.to_body()

    error = _map(agent_error.status, json.dumps(body).encode())

    assert type(error) is ERRORS_BY_CODE[agent_error.code]
    assert (error.status, error.code, error.message, error.retryable) == (
        agent_error.status,
        agent_error.code,
        agent_error.message,
        agent_error.retryable,
    )
    assert dict(error.extra) == dict(agent_error.extra)


def test_typed_attributes() -> None:
    cases: list[tuple[agent_errors.AgentError, dict[str, object]]] = [
        (agent_errors.InvalidRequest("bad", field="count"), {"field": "count"}),
        (agent_errors.NotFound("pod", "jhub/x"), {"resource": "pod", "name": "jhub/x"}),
        (
            agent_errors.Forbidden.over_gpu_limit(limit=4, attached=3, requested=2),
            {"limit": 4, "attached": 3, "requested": 2},
        ),
        (agent_errors.InsufficientGpus(free=0, requested=1), {"free": 0, "requested": 1}),
        (agent_errors.Timeout("slow", wait_seconds=30), {"wait_seconds": 30.0}),
        (agent_errors.InternalError(request_id="r-1"), {"request_id": "r-1"}),
        (
            agent_errors.Busy.gpu_in_use(GpuUuid("GPU-1"), [{"pid": 7, "command": "python"}]),
            {"processes": (BusyProcess(7, "python"),), "uuid": "GPU-1"},
        ),
    ]
    for agent_error, expected in cases:
        error = _map(agent_error.status, json.dumps(agent_error.to_body()).encode())
        assert {name: getattr(error, name) for name in expected} == expected


def test_typed_attributes_tolerate_odd_members() -> None:
    body = {
        "error": "busy",
        "message": "m",
        "retryable": "yes",
        "processes": [{"pid": "7", "command": "x"}, 3, {"pid": 8, "command": "ok"}],
        "uuid": 5,
    }

    error = _map(409, json.dumps(body).encode())

    assert isinstance(error, Busy)
    assert error.processes == (BusyProcess(8, "ok"),)
    assert error.uuid is None
    assert error.retryable is True, "not a bool: the class default"


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, InvalidRequest),
        (401, Unauthenticated),
        (403, Forbidden),
        (404, NotFound),
        (409, Busy),
        (422, TargetNotReady),
        (504, AgentTimeout),
        (500, AgentInternalError),
        (503, AgentInternalError),
        (418, AgentError),
    ],
)
def test_unknown_codes_map_by_status(status: int, cls: type[AgentError]) -> None:
    body = {"error": "brand_new", "message": "something new", "retryable": False}

    error = _map(status, json.dumps(body).encode())

    assert type(error) is cls
    assert (error.code, error.message, error.status) == ("brand_new", "something new", status)


@pytest.mark.parametrize(
    "body",
    [b"", b"Service Unavailable", b"[1, 2]", b'{"error": 5, "message": "x"}', b"\xff\xfe"],
    ids=["empty", "text", "json-array", "wrong-types", "binary"],
)
def test_bodies_that_are_not_the_api_json(body: bytes) -> None:
    error = _map(503, body)

    assert type(error) is AgentInternalError
    assert error.code == "internal_error"
    assert error.retryable, "the class default"
    assert error.message.startswith(
        f"The GPU agent at {URL} answered the request to attach 1 GPU with HTTP 503 Reason"
    )


def test_long_bodies_are_clipped() -> None:
    error = _map(500, b"x " * 1000)

    snippet = error.message.split("Reason: ", 1)[1]
    assert len(snippet) == 200
    assert snippet.endswith("x…")


def test_missing_token_is_mentioned_only_for_401() -> None:
    body = json.dumps(agent_errors.Unauthenticated("no credentials").to_body()).encode()
    forbidden = json.dumps(agent_errors.Forbidden("not yours").to_body()).encode()

    unauthenticated = _map(401, body, missing_token="the token file /t does not exist")
    other = _map(403, forbidden, missing_token="the token file /t does not exist")

    assert unauthenticated.message.endswith(
        "(No token was sent: the token file /t does not exist.)"
    )
    assert "token file /t" not in other.message


def test_unavailable_message() -> None:
    error = errors.AgentUnavailable(agent_url=URL, reason="No such file or directory")

    assert (
        str(error)
        == error.message
        == (
            "No GPU agent on this node: could not connect to unix:/run/gpu-hotplug/agent.sock "
            "(No such file or directory). Ask your platform administrator whether GPU hot-plug is "
            "enabled here."
        )
    )
