"""The local-mode agent the runtime tests talk to: a real subprocess with simulated GPUs and a
short reconcile interval (a lost grant must come back within one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.agent_process import AgentProcess

GPUS = 2
RECONCILE_INTERVAL = 1.0


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    process = AgentProcess(
        tmp_path / "state",
        simulate=GPUS,
        extra_args=[f"--reconcile-interval={RECONCILE_INTERVAL}"],
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()
