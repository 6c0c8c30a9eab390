"""Both clients against a real stub agent, over TCP and a unix socket.

What is proven here, end to end through real sockets: each method sends the contract's request
and returns typed values; the token file is re-read on every call; retries happen exactly
where they are safe; every API error arrives as its own exception; an unreachable or silent
agent becomes a helpful ``AgentClientError``, never a socket traceback.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PidRef, PodTarget
from jupyter_gpu_hotplug.agent.core import errors as agent_errors
from jupyter_gpu_hotplug.client import (
    AgentClient,
    AgentConnectionLost,
    AgentError,
    AgentInternalError,
    AgentProtocolError,
    AgentUnavailable,
    AsyncAgentClient,
    Attachment,
    Busy,
    BusyProcess,
    ClientConfigError,
    Forbidden,
    Gpu,
    Health,
    InsufficientGpus,
    InvalidRequest,
    RetryPolicy,
    Suspension,
    Timeouts,
    Unauthenticated,
)
from tests.agent.test_errors import CASES as AGENT_ERROR_CASES

from . import samples
from .conftest import TOKEN, Api
from .stub_agent import StubAgent, check_against_contract, check_attach_request

UNIX_HINT = "Ask your platform administrator whether GPU hot-plug is enabled here."

# --- each method: request sent, value returned ---------------------------------------------------


async def test_gpus(api: Api, stub: StubAgent) -> None:
    stub.respond("GET", "/v1/gpus", 200, samples.GPUS)

    gpus = await api("gpus")

    assert gpus == (
        Gpu(
            uuid=samples.UUID_A,
            index=0,
            minor=3,
            name="NVIDIA H100 80GB HBM3",
            memory_total=81559 * 2**20,
            state="attached",
            target=samples.POD,
            simulated=False,
            raw=samples.GPUS["gpus"][0],
            selectable=True,
        ),
        Gpu(
            uuid=samples.UUID_B,
            index=1,
            minor=4,
            name="NVIDIA H100 80GB HBM3 (simulated)",
            memory_total=0,
            state="free",
            target=None,
            simulated=True,
            raw=samples.GPUS["gpus"][1],
            selectable=True,
        ),
    )
    assert gpus[0].device == "/dev/nvidia3"
    assert gpus[1].raw == samples.GPUS["gpus"][1]
    (request,) = stub.requests
    assert (request.method, request.path, request.query) == ("GET", "/v1/gpus", {})
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert request.headers["Accept"] == "application/json"
    assert request.headers["User-Agent"].startswith("jupyter-gpu-hotplug/")


@pytest.mark.parametrize(
    ("target", "query"),
    [
        (None, {}),
        (
            PodTarget("jhub", "jupyter-ada", "notebook"),
            {"pod": "jhub/jupyter-ada", "container": "notebook"},
        ),
        (PodTarget("jhub", "jupyter-ada"), {"pod": "jhub/jupyter-ada"}),
        (PidRef(4242), {"pid": "4242"}),
    ],
    ids=["caller", "pod-container", "pod", "pid"],
)
async def test_attachments(
    api: Api, stub: StubAgent, target: PodTarget | PidRef | None, query: dict[str, str]
) -> None:
    stub.respond("GET", "/v1/attachments", 200, samples.ATTACHMENTS)

    (attachment,) = await api("attachments", target)

    assert attachment == Attachment(
        uuid=samples.UUID_A,
        index=0,
        minor=3,
        name="NVIDIA H100 80GB HBM3",
        device="/dev/nvidia3",
        target=samples.POD,
        holder="jhub/gpu-holder-x7k2p",
        attached_at=dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        raw=samples.ATTACHMENTS["attachments"][0],
    )
    (request,) = stub.requests
    assert (request.path, request.query) == ("/v1/attachments", query)


async def test_attach_sends_the_contract_body(api: Api, stub: StubAgent) -> None:
    stub.respond("POST", "/v1/attachments", 201, samples.LOCAL_ATTACHMENTS)

    (attachment,) = await api(
        "attach", 2, target=PidRef(4242), wait_seconds=12.5, request_id="my-request.1"
    )

    assert attachment.target == PidRef(4242)
    assert attachment.holder is None
    assert attachment.attached_at == dt.datetime(2025, 1, 2, 2, 4, 5, 250000, tzinfo=dt.UTC)
    (request,) = stub.requests
    assert request.headers["Content-Type"] == "application/json"
    body = request.json()
    assert body == {
        "count": 2,
        "target": {"pid": 4242},
        "wait_seconds": 12.5,
        "request_id": "my-request.1",
    }
    check_attach_request(body)


async def test_attach_names_its_gpus(api: Api, stub: StubAgent) -> None:
    stub.respond("POST", "/v1/attachments", 201, samples.LOCAL_ATTACHMENTS)
    second = samples.GPUS["gpus"][1]["uuid"]

    await api("attach", 1, target=PidRef(4242), gpus=[second], request_id="r.2")

    (request,) = stub.requests
    body = request.json()
    assert body == {"count": 1, "target": {"pid": 4242}, "request_id": "r.2", "gpus": [second]}
    check_attach_request(body)


@pytest.mark.parametrize(
    ("memory", "sent"), [("80G", 80 * 10**9), ("40Gi", 40 * 2**30), (512 * 2**20, 512 * 2**20)]
)
async def test_attach_selects_by_model_and_memory(
    api: Api, stub: StubAgent, memory: str | int, sent: int
) -> None:
    stub.respond("POST", "/v1/attachments", 201, samples.LOCAL_ATTACHMENTS)

    await api("attach", 1, target=PidRef(4242), model="H100", min_memory=memory, request_id="r.3")

    (request,) = stub.requests
    body = request.json()
    assert body == {
        "count": 1,
        "target": {"pid": 4242},
        "request_id": "r.3",
        "model": "H100",
        "min_memory": sent,
    }
    check_attach_request(body)


async def test_attach_defaults(api: Api, stub: StubAgent) -> None:
    stub.respond("POST", "/v1/attachments", 201, samples.ATTACHMENTS)

    await api("attach")
    await api("attach", 1, target=samples.POD)

    first, second = (request.json() for request in stub.requests)
    assert set(first) == {"count", "request_id"}
    assert first["count"] == 1
    assert second["target"] == {
        "pod": {"namespace": "jhub", "name": "jupyter-ada", "container": "notebook"}
    }
    assert first["request_id"] != second["request_id"], "a new request id per call"
    check_attach_request(first)
    check_attach_request(second)


@pytest.mark.parametrize(("force", "query"), [(False, {}), (True, {"force": "true"})])
async def test_detach(api: Api, stub: StubAgent, force: bool, query: dict[str, str]) -> None:
    stub.respond("DELETE", "/v1/attachments/{uuid}", 204)

    assert await api("detach", samples.UUID_A, force=force) is None

    (request,) = stub.requests
    assert (request.method, request.path, request.query) == (
        "DELETE",
        f"/v1/attachments/{samples.UUID_A}",
        query,
    )


async def test_detach_quotes_the_uuid(api: Api, stub: StubAgent) -> None:
    stub.respond("DELETE", "/v1/attachments/{uuid}", 204)

    await api("detach", "GPU-x/../../healthz?a=b")

    (request,) = stub.requests
    assert request.path == "/v1/attachments/GPU-x%2F..%2F..%2Fhealthz%3Fa%3Db"
    assert request.query == {}


@pytest.mark.parametrize(
    ("target", "force", "query"),
    [
        (None, False, {}),
        (PidRef(77), True, {"pid": "77", "force": "true"}),
        (samples.POD, False, {"pod": "jhub/jupyter-ada", "container": "notebook"}),
    ],
    ids=["caller", "pid-force", "pod"],
)
async def test_detach_all(
    api: Api,
    stub: StubAgent,
    target: PodTarget | PidRef | None,
    force: bool,
    query: dict[str, str],
) -> None:
    stub.respond("DELETE", "/v1/attachments", 204)

    assert await api("detach_all", target=target, force=force) is None

    (request,) = stub.requests
    assert (request.method, request.path, request.query) == ("DELETE", "/v1/attachments", query)


async def test_detach_all_keep_sends_keep(api: Api, stub: StubAgent) -> None:
    stub.respond("DELETE", "/v1/attachments", 204)

    assert await api("detach_all", target=PidRef(77), keep=True) is None

    (request,) = stub.requests
    assert (request.method, request.path, request.query) == (
        "DELETE",
        "/v1/attachments",
        {"pid": "77", "keep": "true"},
    )


async def test_detach_all_refuses_keep_with_force_before_sending(api: Api, stub: StubAgent) -> None:
    with pytest.raises(InvalidRequest, match="force and keep exclude each other") as caught:
        await api("detach_all", force=True, keep=True)

    assert (caught.value.status, caught.value.field, caught.value.retryable) == (400, "keep", False)
    assert stub.requests == [], "nothing reaches the agent"


async def test_attachment_state_reads_the_suspension(api: Api, stub: StubAgent) -> None:
    stub.respond("GET", "/v1/attachments", 200, samples.SUSPENDED)

    state = await api("attachment_state", PidRef(4242))

    assert state.attachments == ()
    assert state.suspended == Suspension(
        state="suspended",
        model="NVIDIA H100 80GB HBM3",
        uuids=(samples.UUID_A,),
        pids=(4242,),
        host_memory=3 * 2**30,
    )
    (request,) = stub.requests
    assert (request.path, request.query) == ("/v1/attachments", {"pid": "4242"})


async def test_attachment_state_without_a_suspension(api: Api, stub: StubAgent) -> None:
    stub.respond("GET", "/v1/attachments", 200, samples.ATTACHMENTS)

    state = await api("attachment_state")

    assert [a.uuid for a in state.attachments] == [samples.UUID_A]
    assert state.suspended is None


async def test_health_sends_no_token(api: Api, stub: StubAgent) -> None:
    stub.respond("GET", "/healthz", 200, {"status": "ok"})

    assert await api("health") == Health(status="ok")

    (request,) = stub.requests
    assert "Authorization" not in request.headers


# --- the token -----------------------------------------------------------------------------------


async def test_token_is_reread_on_every_call(api: Api, stub: StubAgent, token_file: Path) -> None:
    stub.respond("GET", "/v1/gpus", 200, samples.GPUS)

    await api("gpus")
    rotated = token_file.with_name("token.new")
    rotated.write_text("token-2")
    os.replace(rotated, token_file)  # how the kubelet swaps a projected token
    await api("gpus")

    assert [r.headers["Authorization"] for r in stub.requests] == [
        f"Bearer {TOKEN}",
        "Bearer token-2",
    ]


async def test_missing_token_file_sends_no_authorization(
    make_api: Callable[..., Api], agent_url: str, stub: StubAgent, tmp_path: Path
) -> None:
    stub.respond("GET", "/v1/gpus", 200, samples.GPUS)
    missing = tmp_path / "no-such-token"

    await make_api(agent_url, token_path=missing)("gpus")
    await make_api(agent_url)("gpus")

    assert all("Authorization" not in request.headers for request in stub.requests)


@pytest.mark.parametrize("configured", [True, False], ids=["file-missing", "not-configured"])
async def test_401_without_token_says_why(
    make_api: Callable[..., Api],
    agent_url: str,
    stub: StubAgent,
    tmp_path: Path,
    configured: bool,
) -> None:
    stub.respond("GET", "/v1/gpus", 401, agent_errors.Unauthenticated("no credentials").to_body())
    missing = tmp_path / "no-such-token"
    api = make_api(agent_url, token_path=missing if configured else None)

    with pytest.raises(Unauthenticated) as caught:
        await api("gpus")

    assert caught.value.message.startswith("no credentials; send 'Authorization: Bearer")
    if configured:
        assert caught.value.message.endswith(
            f"(No token was sent: the token file {missing} does not exist.)"
        )
    else:
        assert "GPU_HOTPLUG_TOKEN_PATH is not set" in caught.value.message
    assert len(stub.requests) == 1, "an error answer is not retried"


async def test_401_with_a_token_is_the_agents_word(api: Api, stub: StubAgent) -> None:
    body = agent_errors.Unauthenticated("the token has expired").to_body()
    stub.respond("GET", "/v1/gpus", 401, body)

    with pytest.raises(Unauthenticated) as caught:
        await api("gpus")

    assert caught.value.message == body["message"]


@pytest.mark.parametrize(
    "content", [None, "two words", "émoji-\u2603"], ids=["directory", "space", "non-ascii"]
)
async def test_unusable_token_file(
    make_api: Callable[..., Api],
    agent_url: str,
    stub: StubAgent,
    tmp_path: Path,
    content: str | None,
) -> None:
    path = tmp_path / "token"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)

    with pytest.raises(ClientConfigError, match="token file"):
        await make_api(agent_url, token_path=path)("gpus")

    assert stub.requests == [], "nothing is sent with a broken token"


# --- retries -------------------------------------------------------------------------------------


async def test_get_is_retried_after_a_dropped_connection(api: Api, stub: StubAgent) -> None:
    stub.respond("GET", "/v1/gpus", 200, samples.GPUS)
    stub.drop_next("GET", "/v1/gpus")

    assert len(await api("gpus")) == 2

    assert len(stub.requests) == 2


async def test_attach_is_retried_with_the_same_request_id(api: Api, stub: StubAgent) -> None:
    stub.respond("POST", "/v1/attachments", 201, samples.ATTACHMENTS)
    stub.drop_next("POST", "/v1/attachments", times=2)

    (attachment,) = await api("attach", 1)

    assert attachment.uuid == samples.UUID_A
    bodies = [request.json() for request in stub.requests]
    assert len(bodies) == 3
    assert bodies[0] == bodies[1] == bodies[2]
    assert bodies[0]["request_id"], "every attach carries a request id"


async def test_detach_is_not_retried(api: Api, stub: StubAgent) -> None:
    stub.respond("DELETE", "/v1/attachments/{uuid}", 204)
    stub.drop_next("DELETE", "/v1/attachments/{uuid}")

    with pytest.raises(AgentConnectionLost) as caught:
        await api("detach", samples.UUID_A, force=True)

    assert len(stub.requests) == 1
    error = caught.value
    assert not error.timed_out
    assert error.attempts == 1
    assert error.message == (
        f"The GPU agent at {api.client.agent_url} did not answer the request to force-detach "
        f"GPU {samples.UUID_A}: the agent closed the connection without answering. It may "
        "still have done it: check the current GPUs before trying again, and if this keeps "
        "happening, ask your platform administrator to look at the agent's log."
    )


async def test_detach_all_is_not_retried(api: Api, stub: StubAgent) -> None:
    stub.respond("DELETE", "/v1/attachments", 204)
    stub.drop_next("DELETE", "/v1/attachments")

    with pytest.raises(AgentConnectionLost):
        await api("detach_all")

    assert len(stub.requests) == 1


async def test_retries_give_up(api: Api, stub: StubAgent) -> None:
    stub.respond("GET", "/v1/gpus", 200, samples.GPUS)
    stub.drop_next("GET", "/v1/gpus", times=5)

    with pytest.raises(AgentConnectionLost) as caught:
        await api("gpus")

    assert len(stub.requests) == 3
    assert caught.value.attempts == 3
    assert "(tried 3 times)" in caught.value.message


async def test_no_retry_policy(
    make_api: Callable[..., Api], agent_url: str, stub: StubAgent
) -> None:
    stub.respond("GET", "/v1/gpus", 200, samples.GPUS)
    stub.drop_next("GET", "/v1/gpus")

    with pytest.raises(AgentConnectionLost):
        await make_api(agent_url, retry=RetryPolicy(attempts=1))("gpus")

    assert len(stub.requests) == 1


async def test_truncated_answer_is_a_lost_answer(api: Api, stub: StubAgent) -> None:
    stub.send_raw(
        "GET",
        "/v1/gpus",
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"g',
    )

    with pytest.raises(AgentConnectionLost, match="in the middle of the answer"):
        await api("gpus")

    assert len(stub.requests) == 3, "a GET is retried"


async def test_chunked_answer_is_read(api: Api, stub: StubAgent) -> None:
    body = json.dumps(samples.GPUS).encode()
    half = len(body) // 2
    chunks = b"".join(
        f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:half], body[half:])
    )
    stub.send_raw(
        "GET",
        "/v1/gpus",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n",
    )

    assert [gpu.uuid for gpu in await api("gpus")] == [samples.UUID_A, samples.UUID_B]


# --- API errors: one exception per code ----------------------------------------------------------


def _agent_error_cases() -> Iterator[tuple[str, agent_errors.AgentError]]:
    for name, error, *_ in AGENT_ERROR_CASES:
        yield name, error


@pytest.mark.parametrize(
    "agent_error",
    [error for _, error in _agent_error_cases()],
    ids=[name for name, _ in _agent_error_cases()],
)
async def test_every_error_code_raises_its_exception(
    api: Api, stub: StubAgent, agent_error: agent_errors.AgentError
) -> None:
    body = agent_error.to_body()
    # POST /v1/attachments documents every error code.
    stub.respond("POST", "/v1/attachments", agent_error.status, body)

    with pytest.raises(AgentError) as caught:
        await api("attach", 1)

    error = caught.value
    assert type(error).__name__ == {
        "Timeout": "AgentTimeout",
        "InternalError": "AgentInternalError",
    }.get(type(agent_error).__name__, type(agent_error).__name__)
    assert (error.status, error.code, error.message, error.retryable) == (
        agent_error.status,
        agent_error.code,
        agent_error.message,
        agent_error.retryable,
    )
    assert dict(error.extra) == {
        k: v for k, v in body.items() if k not in {"error", "message", "retryable"}
    }
    assert len(stub.requests) == 1, "error answers are the caller's to retry"


async def test_busy_lists_the_processes(api: Api, stub: StubAgent) -> None:
    error = agent_errors.Busy.gpu_in_use(
        samples.UUID_A, [{"pid": 4242, "command": "python"}, {"pid": 4243, "command": "nvtop"}]
    )
    stub.respond("DELETE", "/v1/attachments/{uuid}", 409, error.to_body())

    with pytest.raises(Busy) as caught:
        await api("detach", samples.UUID_A)

    assert caught.value.processes == (BusyProcess(4242, "python"), BusyProcess(4243, "nvtop"))
    assert caught.value.uuid == samples.UUID_A
    assert not caught.value.retryable


async def test_insufficient_gpus_says_how_many(api: Api, stub: StubAgent) -> None:
    error = agent_errors.InsufficientGpus(free=1, requested=3)
    stub.respond("POST", "/v1/attachments", 409, error.to_body())

    with pytest.raises(InsufficientGpus) as caught:
        await api("attach", 3)

    assert (caught.value.free, caught.value.requested) == (1, 3)
    assert caught.value.retryable


async def test_forbidden_over_limit(api: Api, stub: StubAgent) -> None:
    error = agent_errors.Forbidden.over_gpu_limit(limit=2, attached=2, requested=1)
    stub.respond("POST", "/v1/attachments", 403, error.to_body())

    with pytest.raises(Forbidden) as caught:
        await api("attach", 1)

    assert (caught.value.limit, caught.value.attached, caught.value.requested) == (2, 2, 1)


async def test_unknown_code_maps_by_status(api: Api, stub: StubAgent) -> None:
    stub.respond_off_contract(
        "POST",
        "/v1/attachments",
        409,
        json.dumps(
            {"error": "quota_frozen", "message": "quota frozen; ask", "retryable": False, "x": 1}
        ).encode(),
        content_type="application/json",
        off_contract="a code a newer agent might add",
    )

    with pytest.raises(Busy) as caught:
        await api("attach", 1)

    assert (caught.value.code, caught.value.message, caught.value.retryable) == (
        "quota_frozen",
        "quota frozen; ask",
        False,
    )
    assert caught.value.extra == {"x": 1}


async def test_non_json_error_body(api: Api, stub: StubAgent) -> None:
    stub.respond_off_contract(
        "GET",
        "/v1/gpus",
        502,
        b"<html><body><h1>502 Bad Gateway</h1></body></html>",
        content_type="text/html",
        off_contract="a reverse proxy in front of an agent that is down",
    )

    with pytest.raises(AgentInternalError) as caught:
        await api("gpus")

    assert caught.value.message == (
        f"The GPU agent at {api.client.agent_url} answered the request to list the node's GPUs "
        "with HTTP 502 Bad Gateway: <html><body><h1>502 Bad Gateway</h1></body></html>"
    )
    assert caught.value.status == 502
    assert caught.value.request_id is None


@pytest.mark.parametrize(
    ("status", "body", "content_type", "detail"),
    [
        (200, b"not json", "text/plain", "the body is not JSON"),
        (
            200,
            json.dumps({"gpus": [{**samples.GPUS["gpus"][0], "minor": "3"}]}).encode(),
            "application/json",
            "gpus[0].minor must be int, not str",
        ),
        (200, b'{"items": []}', "application/json", "body.gpus is missing"),
        (302, b"", "text/plain", "HTTP 302 Found"),
    ],
    ids=["not-json", "wrong-type", "missing-member", "redirect"],
)
async def test_answers_outside_the_contract(
    api: Api, stub: StubAgent, status: int, body: bytes, content_type: str, detail: str
) -> None:
    stub.respond_off_contract(
        "GET", "/v1/gpus", status, body, content_type=content_type, off_contract="broken on purpose"
    )

    with pytest.raises(AgentProtocolError) as caught:
        await api("gpus")

    assert detail in caught.value.message
    assert caught.value.message.startswith(
        f"Unexpected answer from the GPU agent at {api.client.agent_url} to the request to list "
        "the node's GPUs: "
    )


async def test_not_http_at_all(api: Api, stub: StubAgent) -> None:
    stub.send_raw("GET", "/v1/gpus", b"SSH-2.0-OpenSSH_9.2\r\n\r\n")

    with pytest.raises(AgentProtocolError, match="not an HTTP response"):
        await api("gpus")


# --- no agent, silent agent ----------------------------------------------------------------------


async def test_no_socket_is_no_agent(make_api: Callable[..., Api], short_dir: Path) -> None:
    url = f"unix:{short_dir}/agent.sock"

    with pytest.raises(AgentUnavailable) as caught:
        await make_api(url)("gpus")

    assert caught.value.message == (
        f"No GPU agent on this node: could not connect to {url} (No such file or directory). "
        + UNIX_HINT
    )
    assert caught.value.retryable


@pytest.fixture
def closed_port() -> int:
    """A TCP port on which nothing listens (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("method", ["gpus", "detach_all"])
async def test_refused_connection_is_no_agent(
    make_api: Callable[..., Api], closed_port: int, method: str
) -> None:
    url = f"http://127.0.0.1:{closed_port}"

    with pytest.raises(AgentUnavailable) as caught:
        await make_api(url)(method)

    assert caught.value.message == (
        f"No GPU agent on this node: could not connect to {url} (Connection refused). " + UNIX_HINT
    )
    assert isinstance(caught.value.__cause__, Exception)


async def test_read_timeout(make_api: Callable[..., Api], agent_url: str, stub: StubAgent) -> None:
    stub.hang("GET", "/v1/gpus")
    api = make_api(
        agent_url,
        timeouts=Timeouts(connect=5, read=0.2),
        retry=RetryPolicy(attempts=2, first_delay=0.0, max_delay=0.0),
    )

    with pytest.raises(AgentConnectionLost) as caught:
        await api("gpus")

    assert caught.value.timed_out
    assert "no answer within 0.2 s (tried 2 times)" in caught.value.message
    assert len(stub.requests) == 2


@pytest.fixture
def full_backlog() -> Iterator[int]:
    """A listening port whose accept queue is full: new connections hang in SYN_SENT."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    fillers = []
    try:
        for _ in range(64):
            filler = socket.socket()
            fillers.append(filler)
            filler.settimeout(0.2)
            try:
                filler.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.fail("could not fill the accept queue: this kernel accepts without limit")
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def test_connect_timeout(make_api: Callable[..., Api], full_backlog: int) -> None:
    url = f"http://127.0.0.1:{full_backlog}"
    api = make_api(url, timeouts=Timeouts(connect=0.2, read=5), retry=RetryPolicy(attempts=1))

    with pytest.raises(AgentUnavailable) as caught:
        await api("detach", samples.UUID_A)

    assert "(no connection within 0.2 s)" in caught.value.message


# --- TLS ---------------------------------------------------------------------------------------


async def test_https(
    make_api: Callable[..., Api], tls_stub: StubAgent, tls_certificate: tuple[Path, Path]
) -> None:
    tls_stub.respond("GET", "/v1/gpus", 200, samples.GPUS)
    trusting = ssl.create_default_context(cafile=str(tls_certificate[0]))

    gpus = await make_api(tls_stub.https_url, ssl_context=trusting)("gpus")

    assert len(gpus) == 2
    assert tls_stub.requests[0].headers["Host"] == f"localhost:{tls_stub.tls_port}"


async def test_https_untrusted_certificate(
    make_api: Callable[..., Api], tls_stub: StubAgent
) -> None:
    with pytest.raises(AgentUnavailable) as caught:
        await make_api(tls_stub.https_url, retry=RetryPolicy(attempts=1))("gpus")

    assert "its TLS certificate was not accepted: self-signed certificate" in caught.value.message
    assert tls_stub.requests == []


# --- configuration -------------------------------------------------------------------------------


async def test_from_environment(flavour: str, stub: StubAgent, token_file: Path) -> None:
    stub.respond("GET", "/v1/gpus", 200, samples.GPUS)
    cls = AgentClient if flavour == "sync" else AsyncAgentClient
    environ = {"GPU_HOTPLUG_AGENT_URL": stub.unix_url, "GPU_HOTPLUG_TOKEN_PATH": str(token_file)}

    client = cls.from_environment(environ)
    await Api(client)("gpus")

    assert client.agent_url == stub.unix_url
    assert client.token_path == token_file
    assert stub.requests[0].headers["Authorization"] == f"Bearer {TOKEN}"


def test_from_environment_defaults() -> None:
    client = AgentClient.from_environment({"GPU_HOTPLUG_TOKEN_PATH": ""})

    assert client.agent_url == "unix:/run/gpu-hotplug/agent.sock"
    assert client.token_path is None


@pytest.mark.parametrize(
    "url",
    ["ftp://agent", "unix:relative.sock", "http://", "http://u:p@agent:1", "unix:/" + "x" * 120],
)
def test_bad_agent_url(url: str) -> None:
    with pytest.raises(ClientConfigError, match="agent URL"):
        AsyncAgentClient(url)


def test_canned_answers_are_checked() -> None:
    """The stub refuses an answer the contract does not allow (guards the guard)."""
    with pytest.raises(AssertionError, match="breaks the contract"):
        check_against_contract("GET", "/v1/gpus", 200, {"gpus": [{"uuid": "GPU-1"}]})
    with pytest.raises(AssertionError, match="no documented 409"):
        check_against_contract("GET", "/v1/gpus", 409, {})
