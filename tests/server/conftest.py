"""Fixtures of the server extension's tests: the environment its settings read, and the
agent the REST API tests talk to (by default the ``local_agent`` subprocess).

A module's ``jp_server_config`` reads ``agent_url`` and ``token_path`` (see
``api_support.local_mode``), so a test class can point the server elsewhere by overriding
just these two (``api_support.NoAgent``: nobody listening, no token).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_gpu_hotplug.client import AGENT_URL_ENV, TOKEN_PATH_ENV
from jupyter_gpu_hotplug.nvml.sim import CONFIG_ENV
from jupyter_gpu_hotplug.server.config import KUBERNETES_ENV, MODE_ENV
from tests.fixtures.agent import LocalAgent
from tests.fixtures.nvml import FakeNvml


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No setting of the extension in the environment; set some with the returned patcher."""
    for name in (AGENT_URL_ENV, TOKEN_PATH_ENV, MODE_ENV, KUBERNETES_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def agent_url(local_agent: LocalAgent) -> str:
    return local_agent.tcp_url


@pytest.fixture
def token_path(local_agent: LocalAgent) -> Path | None:
    return local_agent.token_path


@pytest.fixture
def server_nvml(
    fake_nvml: FakeNvml, local_agent: LocalAgent, monkeypatch: pytest.MonkeyPatch
) -> FakeNvml:
    """This process's NVML reads the agent's simulated node, as a demo's server does."""
    monkeypatch.setenv(CONFIG_ENV, str(local_agent.simulation_config))
    return fake_nvml
