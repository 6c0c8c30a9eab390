"""The shared call logic without sockets: the retry rule, timeouts, what each call sends."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.client import AgentConnectionLost, AgentUnavailable
from jupyter_gpu_hotplug.client._core import (
    DEFAULT_WAIT_SECONDS,
    ApiCall,
    ClientCore,
    RetryPolicy,
    Timeouts,
    attach,
    detach,
    detach_all,
    health,
    list_attachments,
    list_gpus,
    new_request_id,
)
from jupyter_gpu_hotplug.client._http import Stage, TransportFailure

from .stub_agent import DOC

CALLS: dict[str, ApiCall[Any]] = {
    "gpus": list_gpus(),
    "attachments": list_attachments(None),
    "attach": attach(1, target=None, wait_seconds=None, request_id=None),
    "detach": detach("GPU-1", force=False),
    "detach-force": detach("GPU-1", force=True),
    "detach_all": detach_all(target=None, force=True),
    "detach_all-keep": detach_all(target=None, force=False, keep=True),
    "health": health(),
}

# (call, stage) -> may be repeated: the retry rule of _core's docstring, as a table.
REPEATABLE = {
    **{(name, Stage.CONNECT): True for name in CALLS},
    ("gpus", Stage.EXCHANGE): True,
    ("attachments", Stage.EXCHANGE): True,
    ("attach", Stage.EXCHANGE): True,
    ("health", Stage.EXCHANGE): True,
    ("detach", Stage.EXCHANGE): False,
    ("detach-force", Stage.EXCHANGE): False,
    ("detach_all", Stage.EXCHANGE): False,
    ("detach_all-keep", Stage.EXCHANGE): False,
}


def _core(**options: object) -> ClientCore:
    settings: dict[str, object] = {
        "token_path": None,
        "timeouts": Timeouts(),
        "retry": RetryPolicy(attempts=3, first_delay=0.5, max_delay=0.75),
        "ssl_context": None,
    }
    settings.update(options)
    return ClientCore("unix:/x.sock", **settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "stage"), list(REPEATABLE), ids=str)
def test_retry_rule(name: str, stage: Stage) -> None:
    core = _core()
    failure = TransportFailure(stage, "reset")

    if REPEATABLE[(name, stage)]:
        assert core.after_failure(CALLS[name], failure, attempt=1) == 0.5
        assert core.after_failure(CALLS[name], failure, attempt=2) == 0.75
        expected: type[Exception] = (
            AgentUnavailable if stage is Stage.CONNECT else AgentConnectionLost
        )
        with pytest.raises(expected) as caught:
            core.after_failure(CALLS[name], failure, attempt=3)
    else:
        with pytest.raises(AgentConnectionLost) as caught:
            core.after_failure(CALLS[name], failure, attempt=1)
    assert caught.value.__cause__ is failure


def test_retry_policy() -> None:
    policy = RetryPolicy(attempts=5, first_delay=0.25, max_delay=1.0)

    assert [policy.delay(n) for n in range(1, 5)] == [0.25, 0.5, 1.0, 1.0]
    for bad in ({"attempts": 0}, {"first_delay": -1.0}, {"first_delay": 3.0, "max_delay": 1.0}):
        with pytest.raises(ValueError, match="invalid retry policy"):
            RetryPolicy(**bad)


@pytest.mark.parametrize("bad", [{"connect": 0}, {"read": -1.0}])
def test_timeouts_must_be_positive(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="positive"):
        Timeouts(**bad)


@pytest.mark.parametrize(
    ("wait_seconds", "read_timeout"), [(None, 10 + DEFAULT_WAIT_SECONDS), (120, 130)]
)
def test_attach_waits_as_long_as_the_agent_may(
    wait_seconds: float | None, read_timeout: float
) -> None:
    core = _core(timeouts=Timeouts(connect=1, read=10))
    call = attach(1, target=None, wait_seconds=wait_seconds, request_id=None)

    assert core.prepare(call).read_timeout == read_timeout
    assert core.prepare(list_gpus()).read_timeout == 10


def test_default_wait_is_the_contracts() -> None:
    schema = DOC["components"]["schemas"]["AttachRequest"]["properties"]["wait_seconds"]
    assert schema["default"] == DEFAULT_WAIT_SECONDS


def test_request_ids_fit_the_contract() -> None:
    pattern = DOC["components"]["schemas"]["AttachRequest"]["properties"]["request_id"]["pattern"]
    ids = {new_request_id() for _ in range(100)}

    assert len(ids) == 100
    assert all(re.search(pattern, request_id) for request_id in ids)


def test_operations_read_well() -> None:
    assert attach(2, target=PidRef(42), wait_seconds=None, request_id=None).operation == (
        "attach 2 GPUs to process 42"
    )
    assert CALLS["attach"].operation == "attach 1 GPU to this notebook"
    assert CALLS["detach-force"].operation == "force-detach GPU GPU-1"
    assert CALLS["detach_all-keep"].operation == (
        "detach all GPUs of this notebook keeping its CUDA state"
    )


def test_prepare_sends_the_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("  abc.def \n")
    core = _core(token_path=token)

    prepared = core.prepare(list_gpus())

    assert b"\r\nAuthorization: Bearer abc.def\r\n" in prepared.payload
    assert prepared.missing_token is None
    assert b"Authorization" not in core.prepare(health()).payload


def test_empty_token_file_sends_none(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("\n")

    prepared = _core(token_path=token).prepare(list_gpus())

    assert b"Authorization" not in prepared.payload
    assert prepared.missing_token == f"the token file {token} is empty"


def test_https_gets_the_system_trust_store() -> None:
    core = ClientCore(
        "https://agent:8443",
        token_path=None,
        timeouts=Timeouts(),
        retry=RetryPolicy(),
        ssl_context=None,
    )

    assert core.ssl_context is not None
    assert core.ssl_context.check_hostname
