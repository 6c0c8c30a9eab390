"""The HTTP API end to end in one process: routes, statuses, errors, limits, identity.

The agent is served for real (tornado on TCP and a unix socket) over the in-memory host fakes;
every answer is checked against ``openapi.json`` by the client in ``api_harness``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from tornado import web

from jupyter_gpu_hotplug.agent import openapi_document
from jupyter_gpu_hotplug.agent.api.handlers import ApiHandler, Unwell, default_handlers
from jupyter_gpu_hotplug.agent.api.server import ListenError, bind_unix_socket
from jupyter_gpu_hotplug.agent.api.validation import MAX_BODY_BYTES
from jupyter_gpu_hotplug.agent.runtime import HealthProbe
from jupyter_gpu_hotplug.agent.settings import TcpAddress, UnixAddress

from .api_harness import (
    DOC,
    TOKEN,
    Response,
    ServedAgent,
    check_contract,
    self_in,
    serve_agent,
    template_of,
)

PROTECTED = [
    ("GET", "/v1/gpus"),
    ("GET", "/v1/attachments?pid=100"),
    ("POST", "/v1/attachments"),
    ("DELETE", "/v1/attachments?pid=100"),
    ("DELETE", "/v1/attachments/GPU-00000000-0000-4000-8000-000000000000"),
]
ATTACH_100 = {"count": 1, "target": {"pid": 100}}


# --- routes against the document --------------------------------------------------------------


def _handler_methods(handler: type[ApiHandler]) -> set[str]:
    return {
        method.lower()
        for method in handler.SUPPORTED_METHODS
        if getattr(handler, method.lower()) is not getattr(web.RequestHandler, method.lower())
    }


def test_every_route_and_method_is_documented_and_served() -> None:
    served = {}
    for pattern, handler in default_handlers:
        template = template_of(pattern.replace("\\", "").replace("([^/]+)", "x"))
        assert template is not None, pattern
        served[template] = _handler_methods(handler)

    documented = {path: set(operations) for path, operations in DOC["paths"].items()}
    assert served == documented


def test_the_probes_are_public_and_the_agents_documents_need_a_caller(
    served: ServedAgent,
) -> None:
    """The kubelet's probes carry no token; ``/metrics`` and the OpenAPI document are read
    by callers of the API (issue 31): here the token, or a peer of the unix socket."""
    anonymous = served.tcp.with_token(None)

    assert anonymous.get("/healthz").json() == {"status": "ok"}
    for path in ("/metrics", "/v1/openapi.json"):
        refused = anonymous.get(path)
        assert (refused.status, refused.error) == (401, "unauthenticated"), path
    assert served.tcp.get("/v1/openapi.json").body == openapi_document()
    for client in (served.tcp, served.unix):
        metrics = client.get("/metrics")
        assert metrics.headers["Content-Type"].startswith("text/plain")
        assert b'gpu_hotplug_gpus{state="free"} 4.0' in metrics.body


def test_metrics_on_an_address_of_their_own(tmp_path: Path) -> None:
    """``--metrics-listen``: /metrics moves there (no API), the API port keeps /healthz only."""
    with serve_agent(tmp_path, metrics_listen=True) as served:
        assert served.metrics is not None
        assert served.metrics.address != served.tcp.address
        metrics = served.metrics.get("/metrics")
        assert b'gpu_hotplug_gpus{state="free"} 4.0' in metrics.body
        assert served.metrics.with_token(None).get("/metrics").status == 401
        assert served.metrics.get("/healthz").json() == {"status": "ok"}
        for path in ("/v1/gpus", "/v1/openapi.json", "/readyz"):
            # Not a route of this address: the API contract does not apply here.
            refused = served.metrics.with_token(TOKEN).call("GET", path, check=False)
            assert (refused.status, refused.error) == (404, "not_found"), path
        moved = served.tcp.with_token(None).call("GET", "/metrics", check=False)
        assert (moved.status, moved.error) == (404, "not_found")
        assert served.tcp.get("/v1/gpus").status == 200


def test_unknown_route_and_method_are_json(served: ServedAgent) -> None:
    missing = served.tcp.get("/v2/gpus")
    assert (missing.status, missing.error) == (404, "not_found")

    wrong_method = served.tcp.call("PUT", "/v1/gpus", {})
    assert (wrong_method.status, wrong_method.error) == (405, "invalid_request")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/v1/gpus", "GET"),
        ("TRACE", "/healthz", "GET"),
        ("PATCH", "/v1/attachments", "GET, POST, DELETE"),
        ("GET", "/v1/queue/r-1", "DELETE"),
    ],
)
def test_a_405_says_which_methods_are_allowed(
    served: ServedAgent, method: str, path: str, allowed: str
) -> None:
    # RFC 9110 §15.5.6 (schemathesis checks it): every 405 carries Allow.
    response = served.tcp.call(method, path, None if method in ("GET", "TRACE") else {})

    assert (response.status, response.headers.get("Allow")) == (405, allowed)


# --- the happy paths --------------------------------------------------------------------------


def test_attach_list_detach_over_tcp(served: ServedAgent) -> None:
    kernel = served.host.spawn(100, "kernel-a")

    attached = served.tcp.post("/v1/attachments", ATTACH_100)

    assert attached.status == 201
    assert attached.headers["Location"] == "/v1/attachments?pid=100"
    (attachment,) = attached.json()["attachments"]
    assert (attachment["minor"], attachment["device"]) == (0, "/dev/nvidia0")
    listed = served.tcp.get("/v1/attachments?pid=100")
    assert listed.json() == attached.json()
    gpus = served.tcp.get("/v1/gpus").json()["gpus"]
    assert [g["state"] for g in gpus] == ["attached", "free", "free", "free"]

    gone = served.tcp.delete(f"/v1/attachments/{attachment['uuid']}")

    assert (gone.status, gone.body) == (204, b"")
    assert served.injector.usable(kernel.target) == set()
    assert served.tcp.get("/v1/attachments?pid=100").json() == {"attachments": []}


def test_every_answer_is_logged_with_the_caller_and_the_target(
    served: ServedAgent, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 35: successes were logged by tornado's access line only, which names no caller
    # over TCP and no target at all; refusals said why but not who asked.
    served.host.spawn(100, "kernel-a")
    caplog.set_level(logging.INFO, logger="jupyter_gpu_hotplug.agent.api.handlers")

    attached = served.tcp.post("/v1/attachments", ATTACH_100)
    uuid = attached.json()["attachments"][0]["uuid"]
    listed = served.tcp.get("/v1/gpus")
    gone = served.tcp.delete(f"/v1/attachments/{uuid}")
    refused = served.tcp.delete(f"/v1/attachments/{uuid}")
    anonymous = served.tcp.with_token(None).get("/v1/gpus")

    def logged(response: Response) -> tuple[str, str | None, str | None]:
        """The answer's log line (up to the reason), its caller and its target."""
        (record,) = [
            r
            for r in caplog.records
            if getattr(r, "request_id", None) == response.headers["X-Request-Id"]
        ]
        line = record.getMessage().partition(":")[0]
        return line, getattr(record, "caller", None), getattr(record, "target", None)

    tcp = "tcp with token"
    assert logged(attached) == ("POST /v1/attachments -> 201", tcp, "process 100")
    assert logged(listed) == ("GET /v1/gpus -> 200", tcp, None)
    assert logged(gone) == (f"DELETE /v1/attachments/{uuid} -> 204", tcp, f"GPU {uuid}")
    assert refused.status == 404
    assert logged(refused) == (
        f"DELETE /v1/attachments/{uuid} -> 404 not_found",
        tcp,
        f"GPU {uuid}",
    )
    assert anonymous.status == 401
    assert logged(anonymous)[1:] == (None, None)


def test_unix_socket_peer_acts_on_its_own_container_without_token(served: ServedAgent) -> None:
    kernel = served.host.spawn(100, "kernel-a")
    served.host.spawn(200, "kernel-b")
    self_in(served, "kernel-a")

    mine = served.unix.post("/v1/attachments", {"count": 1})
    other = served.unix.post("/v1/attachments", {"count": 1, "target": {"pid": 200}})

    assert mine.status == 201
    assert mine.json()["attachments"][0]["target"] == {"pid": kernel.pid}
    assert (other.status, other.error) == (403, "forbidden")
    assert served.unix.get("/v1/gpus").status == 200
    assert served.unix.delete("/v1/attachments").status == 204
    assert served.ledger.attachments() == []


def test_token_on_the_unix_socket_reaches_other_targets(served: ServedAgent) -> None:
    served.host.spawn(200, "kernel-b")
    self_in(served, "kernel-a")

    response = served.unix.with_token(TOKEN).post(
        "/v1/attachments", {"count": 1, "target": {"pid": 200}}
    )

    assert response.status == 201


# --- identity ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), PROTECTED)
@pytest.mark.parametrize(
    ("transport", "authorization"),
    [
        ("tcp", None),
        ("tcp", "Bearer wrong-token-wrong-token-wrong"),
        ("tcp", f"Basic {TOKEN}"),
        ("tcp", "Bearer "),
        ("unix", "Bearer wrong-token-wrong-token-wrong"),
    ],
    ids=["tcp-no-token", "tcp-wrong-token", "tcp-wrong-scheme", "tcp-empty", "unix-wrong-token"],
)
def test_unauthenticated_changes_nothing(
    served: ServedAgent, method: str, path: str, transport: str, authorization: str | None
) -> None:
    kernel = served.host.spawn(100, "kernel-a")
    client = (served.tcp if transport == "tcp" else served.unix).with_token(None)
    headers = {} if authorization is None else {"Authorization": authorization}

    response = client.call(method, path, ATTACH_100 if method == "POST" else None, headers=headers)

    assert (response.status, response.error) == (401, "unauthenticated")
    assert served.injector.calls == []
    assert served.ledger.attachments() == []
    assert served.injector.usable(kernel.target) == set()


def test_tcp_without_token_cannot_name_another_pid(served: ServedAgent) -> None:
    served.host.spawn(100, "kernel-a")

    response = served.tcp.with_token(None).post("/v1/attachments", ATTACH_100)

    assert response.status == 401
    assert served.ledger.attachments() == []


# --- bad input --------------------------------------------------------------------------------

UUID0 = "GPU-00000000-0000-4000-8000-000000000000"
CODES = {400: "invalid_request", 403: "forbidden", 404: "not_found", 409: "insufficient_gpus"}
PID_100 = '"target": {"pid": 100}'


def bad(
    case: str, method: str, path: str, body: bytes | str | None, status: int, field: str | None
) -> Any:
    raw = body.encode() if isinstance(body, str) else body
    return pytest.param(method, path, raw, status, field, id=case)


def bad_post(case: str, body: bytes | str, status: int, field: str | None) -> Any:
    return bad(case, "POST", "/v1/attachments", body, status, field)


BAD_REQUESTS = [
    bad_post("not-json", "{count: 1", 400, "body"),
    bad_post("empty-body", "", 400, "body"),
    bad_post("array", "[1]", 400, "body"),
    bad_post("not-utf8", b'{"count": "\xff"}', 400, "body"),
    bad_post("nan", '{"count": NaN}', 400, "body"),
    bad_post("duplicate", '{"count":1,"count":1}', 400, "count"),
    bad_post("zero", f'{{"count": 0, {PID_100}}}', 400, "count"),
    bad_post("negative", f'{{"count": -1, {PID_100}}}', 400, "count"),
    # Well formed by the document, refused by what only the agent knows: the target's limit,
    # the node's size, the backend, the transport (schemathesis' positive-data check).
    bad_post("huge-count", f'{{"count": {10**20}, {PID_100}}}', 409, None),
    bad_post("above-node", f'{{"count": 5, {PID_100}}}', 409, None),
    bad_post("fraction-count", f'{{"count": 1.5, {PID_100}}}', 400, "count"),
    bad_post("string-count", f'{{"count": "1", {PID_100}}}', 400, "count"),
    bad_post("unknown-field", '{"count": 1, "gpus": 2}', 400, "gpus"),
    bad_post(
        "unknown-target-field", '{"count": 1, "target": {"pid": 100, "x": 1}}', 400, "target.x"
    ),
    bad_post("pid-1", '{"count": 1, "target": {"pid": 1}}', 400, "target.pid"),
    bad_post("pid-string", '{"count": 1, "target": {"pid": "100"}}', 400, "target.pid"),
    bad_post(
        "pod-in-local-mode",
        '{"count": 1, "target": {"pod": {"namespace": "a", "name": "b"}}}',
        404,
        None,
    ),
    bad_post("nonexistent-pid", '{"count": 1, "target": {"pid": 4000000}}', 404, None),
    bad_post("agent-itself", '{"count": 1, "target": {"pid": 4000}}', 403, None),
    bad("query-on-post", "POST", "/v1/attachments?pid=100", '{"count": 1}', 400, "pid"),
    bad("bad-uuid", "DELETE", "/v1/attachments/GPU-XYZ", None, 400, "uuid"),
    bad(
        "uppercase-uuid",
        "DELETE",
        "/v1/attachments/GPU-0000000A-0000-4000-8000-00000000000F",
        None,
        400,
        "uuid",
    ),
    bad("unknown-uuid", "DELETE", f"/v1/attachments/{UUID0}", None, 404, None),
    bad("bad-force", "DELETE", f"/v1/attachments/{UUID0}?force=yes", None, 400, "force"),
    bad("unknown-query", "GET", "/v1/attachments?pid=100&verbose=1", None, 400, "verbose"),
    bad("pid-and-pod", "GET", "/v1/attachments?pid=100&pod=a/b", None, 400, "pid"),
    bad("pid-zero", "GET", "/v1/attachments?pid=0", None, 400, "pid"),
    bad("pid-text", "GET", "/v1/attachments?pid=abc", None, 400, "pid"),
    bad("pid-twice", "GET", "/v1/attachments?pid=100&pid=100", None, 400, "pid"),
    bad("no-target-over-tcp", "GET", "/v1/attachments", None, 404, None),
    bad("gone-pid-query", "DELETE", "/v1/attachments?pid=4000000", None, 404, None),
]


@pytest.mark.parametrize(("method", "path", "raw", "status", "field"), BAD_REQUESTS)
def test_bad_input_is_a_documented_4xx(
    served: ServedAgent,
    method: str,
    path: str,
    raw: bytes | None,
    status: int,
    field: str | None,
) -> None:
    served.host.spawn(100, "kernel-a")

    response = served.tcp.call(method, path, raw=raw)

    assert (response.status, response.error) == (status, CODES[status]), response.body
    assert response.json().get("field") == field
    assert served.ledger.attachments() == []


def test_oversized_body_is_refused_before_reading_it(served: ServedAgent) -> None:
    served.host.spawn(100, "kernel-a")
    address = served.tcp.address
    assert isinstance(address, TcpAddress)
    head = (
        "POST /v1/attachments HTTP/1.1\r\nHost: agent\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {64 * 2**20}\r\n\r\n"
    )

    # Only the headers are sent: the answer must not wait for 64 MiB of body.
    with socket.create_connection((address.host, address.port), timeout=30) as sock:
        sock.sendall(head.encode())
        sock.sendall(b'{"count": 1, "pad": "')
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        body = reply.read()
    response = Response(reply.status, dict(reply.getheaders()), body)
    check_contract("POST", "/v1/attachments", response)

    # Regression (issue 9): 413, the status HTTP has for it (it was a 400).
    assert (response.status, response.error) == (413, "invalid_request")
    assert response.json()["field"] == "body"
    assert served.injector.calls == []


def test_oversized_chunked_body_is_refused(served: ServedAgent) -> None:
    address = served.tcp.address
    assert isinstance(address, TcpAddress)
    connection = http.client.HTTPConnection(address.host, address.port, timeout=30)
    chunks = [b"x" * 4096] * (MAX_BODY_BYTES // 4096 + 2)
    try:
        connection.request(
            "POST",
            "/v1/attachments",
            body=iter(chunks),
            headers={"Authorization": f"Bearer {TOKEN}", "Transfer-Encoding": "chunked"},
            encode_chunked=True,
        )
        reply = connection.getresponse()
        body = json.loads(reply.read())
    finally:
        connection.close()

    assert (reply.status, body["error"], body["field"]) == (413, "invalid_request", "body")


# --- conflicts --------------------------------------------------------------------------------


def test_insufficient_and_busy_are_409(served: ServedAgent) -> None:
    kernel = served.host.spawn(100, "kernel-a")
    served.host.spawn(200, "kernel-b")
    served.tcp.post("/v1/attachments", {"count": 4, "target": {"pid": 100}})

    short = served.tcp.post("/v1/attachments", {"count": 1, "target": {"pid": 200}})
    assert (short.status, short.error) == (409, "insufficient_gpus")
    assert short.json()["free"] == 0

    served.injector.hold(kernel, 0, pid=101, command="python3")
    busy = served.tcp.delete("/v1/attachments?pid=100")
    assert (busy.status, busy.error) == (409, "busy")
    assert busy.json()["processes"] == [{"pid": 101, "command": "python3"}]

    forced = served.tcp.delete("/v1/attachments?pid=100&force=true")
    assert forced.status == 204
    assert served.ledger.attachments() == []


def test_a_named_gpu_over_http(served: ServedAgent) -> None:
    # Issue 36 item 6: the GPU list says which GPUs may be named; naming one attaches it;
    # a taken one is 409 naming it by index, an unknown one 404 gpu, a malformed one 400.
    served.host.spawn(100, "kernel-a")
    served.host.spawn(200, "kernel-b")
    gpus = served.tcp.get("/v1/gpus").json()["gpus"]
    assert all(g["selectable"] for g in gpus)
    second = gpus[1]["uuid"]

    attached = served.tcp.post(
        "/v1/attachments", {"count": 1, "gpus": [second], "target": {"pid": 100}}
    )
    assert attached.status == 201
    assert [a["uuid"] for a in attached.json()["attachments"]] == [second]

    taken = served.tcp.post(
        "/v1/attachments", {"count": 1, "gpus": [second], "target": {"pid": 200}}
    )
    assert (taken.status, taken.error) == (409, "insufficient_gpus")
    assert taken.json()["message"].startswith(f"GPU 1 ({second}) is attached to process 100")

    unknown = "GPU-deadbeef-0000-4000-8000-000000000000"
    missing = served.tcp.post(
        "/v1/attachments", {"count": 1, "gpus": [unknown], "target": {"pid": 200}}
    )
    assert (missing.status, missing.error) == (404, "not_found")
    assert (missing.json()["resource"], missing.json()["name"]) == ("gpu", unknown)

    mismatched = served.tcp.post(
        "/v1/attachments", {"count": 2, "gpus": [second], "target": {"pid": 200}}
    )
    assert (mismatched.status, mismatched.json()["field"]) == (400, "gpus")
    assert [e.gpu.uuid for e in served.ledger.attachments()] == [second]


def test_over_the_per_target_limit_is_403(tmp_path: Path) -> None:
    with serve_agent(tmp_path, gpus=4, max_gpus=1) as served:
        served.host.spawn(100, "kernel-a")
        assert served.tcp.post("/v1/attachments", ATTACH_100).status == 201

        refused = served.tcp.post("/v1/attachments", ATTACH_100)

        assert (refused.status, refused.error) == (403, "forbidden")
        assert (refused.json()["limit"], refused.json()["attached"]) == (1, 1)
        assert len(served.ledger.attachments()) == 1


# --- failures ---------------------------------------------------------------------------------


def test_unexpected_exception_is_a_json_500_with_request_id(
    served: ServedAgent, caplog: pytest.LogCaptureFixture
) -> None:
    served.inventory.error = RuntimeError("NVML exploded")

    with caplog.at_level(logging.ERROR, logger="jupyter_gpu_hotplug.agent.api.handlers"):
        response = served.tcp.get("/v1/gpus")

    assert (response.status, response.error) == (500, "internal_error")
    request_id = response.json()["request_id"]
    assert request_id in response.json()["message"]
    (record,) = [r for r in caplog.records if request_id in r.getMessage()]
    assert record.exc_info is not None and "NVML exploded" in str(record.exc_info[1])
    assert "NVML exploded" not in response.body.decode()


def test_health_reports_a_failing_probe(served: ServedAgent) -> None:
    served.ledger.close()
    served.run(served.agent.health.probe())

    for path in ("/healthz", "/readyz"):
        response = served.tcp.with_token(None).get(path)

        assert response.status == 503
        assert response.json()["status"] == "failing"
        assert "LedgerError" in response.json()["reason"]


def test_health_while_starting_and_stopping_is_never_a_500() -> None:
    # Regression: before the first probe /healthz answered 500 "not probed yet".
    probe = HealthProbe(_healthy_check)

    assert probe.verdict() is None
    assert probe.readiness() == Unwell("starting", "the agent reconciles its ledger with the host")
    asyncio.run(probe.probe())
    assert probe.verdict() is None and probe.readiness() is None
    probe.stopping()
    assert probe.verdict() is None
    readiness = probe.readiness()
    assert readiness is not None and readiness.status == "stopping"


async def _healthy_check() -> None:
    return None


def test_ready_endpoint(served: ServedAgent) -> None:
    response = served.tcp.with_token(None).get("/readyz")

    assert (response.status, response.json()) == (200, {"status": "ok"})


def test_metrics_count_requests_and_operations(served: ServedAgent) -> None:
    served.host.spawn(100, "kernel-a")
    served.tcp.post("/v1/attachments", ATTACH_100)
    served.tcp.post("/v1/attachments", {"count": 4, "target": {"pid": 100}})

    assert served.sample("gpu_hotplug_attach_total", result="success") == 1
    assert served.sample("gpu_hotplug_attach_total", result="insufficient_gpus") == 1
    assert served.sample("gpu_hotplug_attach_duration_seconds_count") == 2
    assert (
        served.sample(
            "gpu_hotplug_http_requests_total",
            method="POST",
            route="/v1/attachments",
            status="201",
        )
        == 1
    )


# --- sockets ----------------------------------------------------------------------------------


def test_unix_socket_mode(served: ServedAgent) -> None:
    address = served.unix.address
    assert isinstance(address, UnixAddress)
    path = address.path
    assert stat.S_IMODE(path.stat().st_mode) == 0o660


def test_stale_socket_is_replaced_and_a_live_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: what a crashed agent leaves

    live = bind_unix_socket(path, mode=0o600)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with pytest.raises(ListenError, match="another process is serving"):
            bind_unix_socket(path, mode=0o600)
    finally:
        live.close()

    other = tmp_path / "not-a-socket"
    other.write_text("data")
    with pytest.raises(ListenError, match="not a socket"):
        bind_unix_socket(other, mode=0o600)
    assert other.read_text() == "data"


def test_unix_callers_are_logged_with_pid_and_container(
    served: ServedAgent, caplog: pytest.LogCaptureFixture
) -> None:
    # Regression (issue 9): the access log said "(0.0.0.0)" for every unix-socket caller.
    self_in(served, "kernel-logged")
    caplog.set_level(logging.INFO, logger="tornado.access")

    served.unix.get("/v1/gpus")

    # The access line is written just after the answer is sent (in the agent's thread).
    def access_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "GET /v1/gpus" in r.getMessage()]

    deadline = time.monotonic() + 30
    while not access_lines() and time.monotonic() < deadline:
        time.sleep(0.01)
    (line,) = access_lines()
    assert f"pid {os.getpid()} uid {os.getuid()}" in line
    assert "kernel-logged" in line
    assert "0.0.0.0" not in line
