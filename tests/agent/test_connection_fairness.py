"""Attacks on the agent's connection caps (issue 25, item 5) and on its answer to an oversized
upload (issue 23): one caller must not be able to take the agent from the others, and an
ordinary client must read the agent's 413, not a reset.

A real agent (tornado on TCP and a unix socket, identity bound at accept) over the host fakes;
the hostile clients are raw sockets. Before the fix: unix connections were counted per uid
(every root kernel and the Jupyter server shared 64), a connection past its headers could not
be evicted, and authentication came after the body — so 64 stalled connections from one
container, or 512 slow unauthenticated bodies from 8 loopback addresses, answered 503 to
everyone; and a 50 MB upload was answered while the client still sent, which it saw as a
connection reset.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from jupyter_gpu_hotplug.agent.api.limits import DEFAULT_LIMITS
from jupyter_gpu_hotplug.agent.settings import TcpAddress

from .api_harness import TOKEN, ServedAgent, self_in

STALLED_POST = (
    b"POST /v1/attachments HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n{"
)
"""Headers and the first byte of a body that never comes (the slow-body client)."""


def _settled(served: ServedAgent, held: list[socket.socket]) -> bool:
    """The agent has read the headers of every hostile connection: each has been answered (or
    closed) by now, or is open with its request arriving."""
    answered = len(select.select(held, [], [], 0)[0])
    arriving = sum(
        1 for admission in served.agent.server._server._open.values() if admission.phase != "idle"
    )
    return answered + arriving >= len(held)


def _until(condition: Callable[[], bool], what: str) -> None:
    """Poll until ``condition()`` holds (the agent reads the hostile headers on its own loop)."""
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.01)


def _tcp_port(served: ServedAgent) -> int:
    address = served.tcp.address
    assert isinstance(address, TcpAddress)
    return address.port


@contextlib.contextmanager
def _stalled(connect: Iterator[socket.socket]) -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    try:
        for sock in connect:
            sock.sendall(STALLED_POST)
            held.append(sock)
        yield held
    finally:
        for sock in held:
            sock.close()


def _unix(served: ServedAgent, count: int) -> Iterator[socket.socket]:
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(served.agent.settings.listen[1].path))  # type: ignore[union-attr]
        yield sock


def _tcp_from(port: int, sources: list[str], per_source: int) -> Iterator[socket.socket]:
    for source in sources:
        for _ in range(per_source):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", port))
            yield sock


def test_one_containers_stalled_connections_leave_others_served(served: ServedAgent) -> None:
    """64 stalled bodies from one sandbox: another container (same uid 0) is still served."""
    self_in(served, "kernel-a")
    cap = DEFAULT_LIMITS.max_per_peer
    with _stalled(_unix(served, cap)) as held:
        _until(lambda: _settled(served, held), "the hog's connections are past their headers")
        self_in(served, "kernel-b")

        answer = served.unix.get("/v1/attachments")

        assert answer.status == 200, answer.body


def test_slow_unauthenticated_bodies_from_8_addresses_leave_token_holders_served(
    served: ServedAgent,
) -> None:
    """512 slow unauthenticated bodies from 127.0.0.2-9: a token holder is still served (they
    are refused at their headers, and an unauthenticated connection yields its place)."""
    port = _tcp_port(served)
    sources = [f"127.0.0.{n}" for n in range(2, 10)]
    per_source = DEFAULT_LIMITS.max_connections // len(sources)
    with _stalled(_tcp_from(port, sources, per_source)) as held:
        _until(lambda: _settled(served, held), "the slow bodies are past their headers")
        answer = served.tcp.get("/v1/gpus")

        assert answer.status == 200, answer.body
        self_in(served, "kernel-c")
        assert served.unix.get("/v1/attachments").status == 200


def test_eight_containers_at_their_cap_leave_token_holders_and_others_served(
    served: ServedAgent,
) -> None:
    """8 containers x 64 stalled connections (what 8 uids did): a token holder and a ninth
    container are still served; the abusers' slow bodies give way."""
    cap = DEFAULT_LIMITS.max_per_peer
    with contextlib.ExitStack() as stack:
        held: list[socket.socket] = []
        for n in range(8):
            self_in(served, f"hog-{n}")
            held += stack.enter_context(_stalled(_unix(served, cap)))
        _until(lambda: _settled(served, held), "the hogs' connections are past their headers")
        assert served.tcp.get("/v1/gpus").status == 200
        self_in(served, "kernel-d")
        assert served.unix.get("/v1/attachments").status == 200


def _upload(url: str, size: int, token: str | None) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url, data=b"x" * size, method="POST")
    request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_50_mb_upload_reads_the_413(served: ServedAgent, tmp_path: Path) -> None:
    """Issue 23: urllib sends the whole body before it reads; the agent answers 413 at the
    headers and reads (and drops) the rest, so the client sees the answer, not a reset."""
    url = f"http://127.0.0.1:{_tcp_port(served)}/v1/attachments"

    status, body = _upload(url, 50 * 1024 * 1024, TOKEN)

    assert status == 413
    assert body["error"] == "invalid_request"
    status, body = _upload(url, 50 * 1024 * 1024, None)  # refused for its credentials first
    assert status == 401
    assert served.ledger.attachments() == []
