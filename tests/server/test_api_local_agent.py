"""The ``local_agent`` fixture plugin (``tests.fixtures.agent``) that the API tests run against."""

from __future__ import annotations

import stat

import pytest

from jupyter_gpu_hotplug.client import AgentClient, Unauthenticated
from tests.fixtures.agent import LocalAgent, LocalAgentFactory

# Starts real servers or toolchains: left out of the fast default run (conftest.py).
pytestmark = pytest.mark.slow


def test_agent_serves_tcp_with_its_token_and_the_unix_socket(local_agent: LocalAgent) -> None:
    over_tcp = local_agent.client().gpus()
    over_socket = local_agent.client(via_socket=True).gpus()

    assert [gpu.uuid for gpu in over_tcp] == [gpu.uuid for gpu in local_agent.gpus()]
    assert over_socket == over_tcp
    assert all(gpu.simulated and gpu.state == "free" for gpu in over_tcp)
    assert stat.S_IMODE(local_agent.token_path.stat().st_mode) == 0o600
    with pytest.raises(Unauthenticated):
        AgentClient(local_agent.tcp_url).gpus()


def test_agents_are_independent_and_a_killed_one_is_not_a_failure(
    local_agent_factory: LocalAgentFactory,
) -> None:
    one, three = local_agent_factory(simulate=1), local_agent_factory(simulate=3)

    assert (len(one.client().gpus()), len(three.client().gpus())) == (1, 3)
    three.kill()
    assert three.process.returncode == -9
    assert one.stop() == 0  # a clean exit, as the fixture checks at the end of every test
