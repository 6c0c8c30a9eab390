"""Fuzzing tier, agent: schemathesis (``--checks all``) against the agent's own document.

A real ``jupyter gpu-hotplug agent --simulate 4`` subprocess, called over TCP with its token;
every pid the generated requests name is the victim sandbox's (``schemathesis_hooks``), so the
stateful phase really attaches GPUs to a running sandbox and detaches them. Passing means: no
5xx, every status and body as ``/v1/openapi.json`` documents it, every request the document
calls valid accepted (or refused for a reason it lists: 401/403/404/409), every invalid one
refused, ``Allow`` on every 405, authentication never ignored. Afterwards, with the victim's
GPUs detached, its device cgroups and ``/dev`` are as they were: the run left nothing behind.
"""

from __future__ import annotations

import pytest

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.linux import cgroups
from tests.fixtures.agent import LocalAgentFactory
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory

from .host_view import HostView
from .schemathesis_run import command, run

pytestmark = [*needs_root, pytest.mark.fuzz]


async def test_the_agent_does_what_its_document_says(
    local_agent_factory: LocalAgentFactory, sandbox_factory: SandboxFactory
) -> None:
    agent = local_agent_factory(simulate=4)
    victim = sandbox_factory()
    found = cgroups.discover()
    v1_root = None if found.devices_v1 is None else found.devices_v1.mount_point
    before = HostView.of(victim.sandbox, v1_root=v1_root)

    outcome = await run(
        command(
            f"{agent.tcp_url}/v1/openapi.json",
            headers={"Authorization": f"Bearer {agent.token}"},
        ),
        victim_pid=victim.sandbox.pid,
    )

    print(outcome.output)  # the CLI's report (pytest -rP shows it for a passing run)
    assert outcome.returncode == 0, outcome.output
    client = agent.client()
    client.detach_all(target=PidRef(victim.sandbox.pid))
    assert all(gpu.target is None for gpu in client.gpus())
    assert HostView.of(victim.sandbox, v1_root=v1_root) == before
