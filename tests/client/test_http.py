"""HTTP/1.1 framing without sockets: endpoints, request bytes, when an answer is complete.

Also the guarantee that whatever bytes come back, the client raises only its own errors.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpu_hotplug.client import AgentClientError
from jupyter_gpu_hotplug.client._core import ClientCore, RetryPolicy, Timeouts, list_gpus
from jupyter_gpu_hotplug.client._http import (
    MAX_RESPONSE_BYTES,
    AgentEndpoint,
    MalformedResponse,
    ResponseReader,
    Stage,
    TransportFailure,
    decode_response,
    encode_request,
)

from . import samples


@pytest.mark.parametrize(
    ("url", "scheme", "host", "port", "socket_path", "base_path", "host_header"),
    [
        (
            "unix:/run/gpu-hotplug/agent.sock",
            "unix",
            "localhost",
            0,
            "/run/gpu-hotplug/agent.sock",
            "",
            "localhost",
        ),
        ("unix:///run/a.sock", "unix", "localhost", 0, "/run/a.sock", "", "localhost"),
        (
            "http://agent.gpu-hotplug.svc:8080",
            "http",
            "agent.gpu-hotplug.svc",
            8080,
            None,
            "",
            "agent.gpu-hotplug.svc:8080",
        ),
        ("http://10.0.0.7", "http", "10.0.0.7", 80, None, "", "10.0.0.7"),
        ("https://agent/prefix/", "https", "agent", 443, None, "/prefix", "agent"),
        ("http://[fd00::7]:9000", "http", "fd00::7", 9000, None, "", "[fd00::7]:9000"),
        (" http://agent:1 ", "http", "agent", 1, None, "", "agent:1"),
    ],
)
def test_endpoint_parse(
    url: str,
    scheme: str,
    host: str,
    port: int,
    socket_path: str | None,
    base_path: str,
    host_header: str,
) -> None:
    endpoint = AgentEndpoint.parse(url)

    assert (endpoint.scheme, endpoint.host, endpoint.port) == (scheme, host, port)
    assert (endpoint.socket_path, endpoint.base_path) == (socket_path, base_path)
    assert endpoint.host_header == host_header


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("agent:8080", "expected http://"),
        ("ftp://agent", "expected http://"),
        ("unix:agent.sock", "absolute path"),
        ("unix:/" + "a" * 107, "longer than the 107 bytes"),
        ("http://:8080", "has no host"),
        ("http://agent:99999", "out of range"),
        ("http://agent?x=1", "query"),
        ("http://me@agent", "user info"),
        ("http://agent/ü", "printable ASCII"),
        ("unix:/run/my agent.sock", "without spaces"),
    ],
)
def test_endpoint_parse_refuses(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        AgentEndpoint.parse(url)


def test_encode_request() -> None:
    endpoint = AgentEndpoint.parse("http://agent:8080/base")

    data = encode_request(
        endpoint, "POST", "/v1/attachments", headers={"Accept": "application/json"}, body=b"{}"
    )

    assert data == (
        b"POST /base/v1/attachments HTTP/1.1\r\nHost: agent:8080\r\nAccept: application/json\r\n"
        b"Connection: close\r\nContent-Length: 2\r\n\r\n{}"
    )


def test_encode_request_refuses_header_injection() -> None:
    endpoint = AgentEndpoint.parse("unix:/a.sock")

    with pytest.raises(ValueError, match="Authorization"):
        encode_request(
            endpoint, "GET", "/", headers={"Authorization": "Bearer x\r\nX-Evil: 1"}, body=None
        )


def _reader_after(*chunks: bytes) -> list[bool]:
    reader = ResponseReader()
    return [reader.feed(chunk) for chunk in chunks]


@pytest.mark.parametrize(
    ("chunks", "done"),
    [
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",), [True]),
        (
            (b"HTTP/1.1 200 OK\r\nContent-Le", b"ngth: 2\r\n\r", b"\n{", b"}"),
            [False, False, False, True],
        ),
        ((b"HTTP/1.1 204 No Content\r\n\r\n",), [True]),
        ((b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",), [False]),
        ((b"HTTP/1.1 200 OK\r\n\r\n{}",), [False]),
        ((b"HTTP/1.1 100 Continue\r\n\r\n",), [False]),
        ((b"SSH-2.0-OpenSSH\r\n\r\n",), [True]),
    ],
    ids=["sized", "split", "no-content", "chunked-eof", "unsized-eof", "interim", "not-http"],
)
def test_response_reader(chunks: tuple[bytes, ...], done: list[bool]) -> None:
    assert _reader_after(*chunks) == done


def test_response_reader_stops_at_the_size_limit() -> None:
    reader = ResponseReader()
    head = b"HTTP/1.1 200 OK\r\n\r\n"

    assert not reader.feed(head + b"x" * (MAX_RESPONSE_BYTES - len(head)))
    assert reader.feed(b"x")
    with pytest.raises(MalformedResponse, match="larger than"):
        decode_response(reader.data, method="GET")


def test_decode_response() -> None:
    response = decode_response(
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        method="POST",
    )

    assert (response.status, response.reason, response.content_type, response.body) == (
        201,
        "Created",
        "application/json",
        b"{}",
    )


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Le",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{}",
    ],
    ids=["nothing", "short-body", "short-head", "short-chunk"],
)
def test_decode_cut_short_is_a_transport_failure(data: bytes) -> None:
    with pytest.raises(TransportFailure) as caught:
        decode_response(data, method="GET")

    assert caught.value.stage is Stage.EXCHANGE


@pytest.mark.parametrize("data", [b"garbage", b"HTTP/1.1 abc\r\n\r\n", b"\x00\xff\r\n\r\n"])
def test_decode_not_http(data: bytes) -> None:
    with pytest.raises(MalformedResponse):
        decode_response(data, method="GET")


def _core() -> ClientCore:
    return ClientCore(
        "unix:/nowhere.sock",
        token_path=None,
        timeouts=Timeouts(),
        retry=RetryPolicy(attempts=1),
        ssl_context=None,
    )


_HTTPISH = st.one_of(
    st.binary(max_size=300),
    st.builds(
        lambda status, headers, body: f"HTTP/1.1 {status} X\r\n{headers}\r\n".encode() + body,
        st.integers(min_value=0, max_value=999),
        st.sampled_from(
            ["", "Content-Length: 3\r\n", "Transfer-Encoding: chunked\r\n", "Content-Length: x\r\n"]
        ),
        st.one_of(
            st.binary(max_size=100),
            st.just(json.dumps(samples.GPUS).encode()),
            st.just(b'{"error": "busy", "message": "m", "retryable": true, "processes": 3}'),
        ),
    ),
)


@settings(max_examples=400)
@given(_HTTPISH)
def test_any_answer_ends_in_a_value_or_our_error(data: bytes) -> None:
    """Whatever comes back, callers see a result or an ``AgentClientError``, nothing else."""
    core = _core()
    call = list_gpus()
    prepared = core.prepare(call)
    try:
        try:
            result = core.conclude(call, prepared, data)
        except TransportFailure as failure:
            core.after_failure(call, failure, attempt=1)
    except AgentClientError as error:
        assert error.message
    else:
        assert isinstance(result, tuple)
