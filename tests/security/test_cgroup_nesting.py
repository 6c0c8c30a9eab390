"""Attack 3: one container stops all reconciliation and keeps the agent from restarting.

A container nests 1,200 cgroups under its own and exits. The walk below its cgroups (which
processes are left? which cgroups carry the grant?) was recursive and raised RecursionError;
the reconciler caught only the injector's errors, so every pass failed, and an agent
restarted then exited 1 in its start-up reconciliation. Walks are iterative and bounded now,
and no single target's failure stops a pass or the start.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.agent.agent_process import AgentProcess
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory

from .helpers import nest, tcp, unnest

pytestmark = [*needs_root, pytest.mark.slow]

DEPTH = 1200
"""Deeper than Python's default recursion limit (1,000)."""


def test_deeply_nested_exited_container_neither_stops_reconciliation_nor_the_start(
    tmp_path: Path, sandbox_factory: SandboxFactory
) -> None:
    agent = AgentProcess(tmp_path / "state", simulate=2, extra_args=["--reconcile-interval=0"])
    agent.start()
    nested: list[Path] = []
    try:
        hostile, neighbour = sandbox_factory(), sandbox_factory()
        for probe in (hostile, neighbour):
            answer = tcp(agent).post("/v1/attachments", {"count": 1, "target": {"pid": probe.pid}})
            assert answer.status == 201, answer.body
        mine = tcp(agent).get(f"/v1/attachments?pid={neighbour.pid}").json()["attachments"]
        for directory in hostile.sandbox.cgroups.dirs():
            nested += nest(directory, DEPTH)
        hostile.sandbox.send_signal(signal.SIGKILL)
        hostile.sandbox.wait(timeout=30)

        agent.kill9()
        agent.start()  # start-up reconciliation walks the exited container's cgroups

        gpus = tcp(agent).get("/v1/gpus").json()["gpus"]
        assert sorted(g["state"] for g in gpus) == ["attached", "free"], agent.log()
        listed = tcp(agent).get(f"/v1/attachments?pid={neighbour.pid}").json()["attachments"]
        assert [a["uuid"] for a in listed] == [a["uuid"] for a in mine]
        assert neighbour.open(f"/dev/nvidia{mine[0]['minor']}") == "ENXIO"
    finally:
        agent.kill9()
        unnest(nested)
