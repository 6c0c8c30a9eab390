"""Fixtures for the agent client: a real stub agent, and both client flavours behind one API.

Every wire-level test runs four times: blocking and asyncio client, each over TCP and over a
unix socket. Async tests call the blocking client in a worker thread, so one test body serves
both flavours.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_hotplug.client import AgentClient, AsyncAgentClient, RetryPolicy

from .stub_agent import StubAgent, running_stub

NO_PAUSE = RetryPolicy(attempts=3, first_delay=0.0, max_delay=0.0)
"""Retries without pauses: the tests count attempts, they do not time them."""
TOKEN = "token-1.abc_DEF-~+/="


class Api:
    """A client of either flavour, awaited the same way."""

    def __init__(self, client: AgentClient | AsyncAgentClient) -> None:
        self.client = client

    async def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        bound = getattr(self.client, method)
        if isinstance(self.client, AsyncAgentClient):
            return await bound(*args, **kwargs)
        return await asyncio.to_thread(bound, *args, **kwargs)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a unix socket path must fit in 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="ghp-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


@pytest.fixture
def stub(short_dir: Path) -> Iterator[StubAgent]:
    with running_stub(short_dir / "agent.sock") as agent:
        yield agent


@pytest.fixture(params=["tcp", "unix"])
def agent_url(request: pytest.FixtureRequest, stub: StubAgent) -> str:
    return stub.tcp_url if request.param == "tcp" else stub.unix_url


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_api(flavour: str) -> Callable[..., Api]:
    """``make_api(url, **client options)``; retries without pauses unless told otherwise."""

    def make(url: str, **options: Any) -> Api:
        options.setdefault("retry", NO_PAUSE)
        cls = AgentClient if flavour == "sync" else AsyncAgentClient
        return Api(cls(url, **options))

    return make


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def api(make_api: Callable[..., Api], agent_url: str, token_file: Path) -> Api:
    """A client of the current flavour for the stub, on the current transport, with a token."""
    return make_api(agent_url, token_path=token_file)


@pytest.fixture(scope="session")
def tls_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for ``localhost`` and its key, made with the openssl tool."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip(
            "needs the openssl command to make a test certificate (apt-get install openssl)"
        )
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def tls_stub(short_dir: Path, tls_certificate: tuple[Path, Path]) -> Iterator[StubAgent]:
    """The stub agent, also serving HTTPS with ``tls_certificate``."""
    cert, key = tls_certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    with running_stub(short_dir / "agent.sock", tls=context) as agent:
        yield agent
