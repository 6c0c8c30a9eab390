"""Fixtures of the agent's service, reconciler and API tests: the service wired to fakes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.agent.core.workers import Workers

from .api_harness import ServedAgent, serve_agent
from .service_harness import Harness, built


@pytest.fixture
def workers() -> Iterator[Workers]:
    """The threads the service runs blocking calls in."""
    threads = Workers()
    yield threads
    threads.shutdown()


@pytest.fixture
async def harness(tmp_path: Path, workers: Workers) -> AsyncIterator[Harness]:
    """A service with 4 fake GPUs, a real ledger in ``tmp_path`` and fake host seams."""
    async with built(tmp_path, workers) as harness:
        yield harness


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedAgent]:
    """An agent served on TCP and a unix socket over fakes with 4 GPUs (see ``api_harness``)."""
    with serve_agent(tmp_path) as agent:
        yield agent
