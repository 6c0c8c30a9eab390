"""The API error hierarchy: one class per code, the right status, bodies that fit ErrorBody."""

from __future__ import annotations

import inspect
import json
from typing import get_args

import pytest

from jupyter_gpu_hotplug._structs import ErrorBody, ErrorCode, GpuUuid, ProcessInfo
from jupyter_gpu_hotplug.agent.core import errors
from jupyter_gpu_hotplug.agent.core.errors import (
    ERRORS_BY_CODE,
    AgentError,
    Busy,
    Forbidden,
    InsufficientGpus,
    InternalError,
    InvalidRequest,
    NotFound,
    TargetNotReady,
    Timeout,
    Unauthenticated,
)

UUID = GpuUuid("GPU-0123abcd-0000-1111-2222-333344445555")
PROCS = [ProcessInfo(pid=4242, command="python"), ProcessInfo(pid=4243, command="nvidia-smi")]

# (id, error, status, code, retryable, extra members)
CASES: list[tuple[str, AgentError, int, str, bool, dict[str, object]]] = [
    (
        "invalid",
        InvalidRequest("count must be positive", field="count"),
        400,
        "invalid_request",
        False,
        {"field": "count"},
    ),
    ("invalid-no-field", InvalidRequest("bad"), 400, "invalid_request", False, {}),
    ("unauthenticated", Unauthenticated("no bearer token"), 401, "unauthenticated", False, {}),
    ("forbidden", Forbidden("pod a/b is not yours"), 403, "forbidden", False, {}),
    (
        "forbidden-limit",
        Forbidden.over_gpu_limit(limit=2, attached=2, requested=1),
        403,
        "forbidden",
        False,
        {"limit": 2, "attached": 2, "requested": 1},
    ),
    (
        "not-found",
        NotFound("attachment", UUID),
        404,
        "not_found",
        False,
        {"resource": "attachment", "name": UUID},
    ),
    (
        "busy-in-use",
        Busy.gpu_in_use(UUID, PROCS),
        409,
        "busy",
        False,
        {"uuid": UUID, "processes": [dict(p) for p in PROCS]},
    ),
    (
        "busy-in-progress",
        Busy.operation_in_progress("pod a/b"),
        409,
        "busy",
        True,
        {"processes": []},
    ),
    (
        "insufficient",
        InsufficientGpus(free=1, requested=3),
        409,
        "insufficient_gpus",
        True,
        {"free": 1, "requested": 3},
    ),
    ("not-ready", TargetNotReady("container c is waiting"), 422, "target_not_ready", True, {}),
    (
        "not-ready-vm",
        TargetNotReady("gVisor sandbox", retryable=False),
        422,
        "target_not_ready",
        False,
        {},
    ),
    (
        "timeout",
        Timeout("holder pod not running", wait_seconds=60.0),
        504,
        "timeout",
        True,
        {"wait_seconds": 60.0},
    ),
    (
        "internal",
        InternalError(request_id="r-1"),
        500,
        "internal_error",
        True,
        {"request_id": "r-1"},
    ),
]


@pytest.mark.parametrize(
    ("error", "status", "code", "retryable", "extra"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_body_status_and_extras(
    error: AgentError, status: int, code: str, retryable: bool, extra: dict[str, object]
) -> None:
    body = error.to_body()
    assert error.status == status
    assert body == {"error": code, "message": error.message, "retryable": retryable, **extra}
    assert str(error) == error.message
    json.dumps(body)  # the base handler writes it as is


@pytest.mark.parametrize("error", [case[1] for case in CASES], ids=[case[0] for case in CASES])
def test_body_uses_only_declared_members(error: AgentError) -> None:
    body = error.to_body()
    assert ErrorBody.__required_keys__ <= body.keys()
    assert body.keys() <= ErrorBody.__required_keys__ | ErrorBody.__optional_keys__


@pytest.mark.parametrize("error", [case[1] for case in CASES], ids=[case[0] for case in CASES])
def test_message_says_what_happened_and_what_to_do(error: AgentError) -> None:
    what, _, todo = error.message.partition("; ")
    assert what
    assert todo


def test_one_class_per_code() -> None:
    assert set(ERRORS_BY_CODE) == set(get_args(ErrorCode))
    for code, cls in ERRORS_BY_CODE.items():
        assert cls.code == code


def test_every_error_class_is_registered() -> None:
    defined = {
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, AgentError) and cls is not AgentError
    }
    assert defined == set(ERRORS_BY_CODE.values())


def test_specific_hint_replaces_the_default() -> None:
    error = NotFound("pod", "ns/x", hint="is the pod on this node?")
    assert error.message == "pod 'ns/x' not found on this node; is the pod on this node?"
    assert NotFound.default_hint not in error.message


def test_messages_carry_the_numbers() -> None:
    assert "3 GPU(s) requested but 1 free" in InsufficientGpus(free=1, requested=3).message
    in_use = Busy.gpu_in_use(UUID, PROCS).message
    assert "4242 (python)" in in_use
    assert "force=true" in in_use
    assert "request id r-9" in InternalError(request_id="r-9").message


def test_busy_keeps_a_copy_of_the_processes() -> None:
    procs = [ProcessInfo(pid=7, command="a")]
    error = Busy.gpu_in_use(UUID, procs)
    procs.append(ProcessInfo(pid=8, command="b"))
    assert error.to_body()["processes"] == [{"pid": 7, "command": "a"}]
