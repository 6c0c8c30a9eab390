"""The settings the REST API adds to ``GPUHotplug``, and how the app wires and stops it."""

from __future__ import annotations

from typing import Any

import pytest
from jupyter_server.serverapp import ServerApp
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpu_hotplug.client import AgentClient, AsyncAgentClient
from jupyter_gpu_hotplug.server import GPUHotplug, GPUHotplugApp
from jupyter_gpu_hotplug.server.config import KUBERNETES_ENV, MODE_ENV
from jupyter_gpu_hotplug.server.kernel_sandboxes import ProvisionerSandboxes

from .api_support import BrokenClient, Fetch, RegisteredSandboxes, call, manager_of


def test_defaults(clean_env: pytest.MonkeyPatch) -> None:
    settings = GPUHotplug()

    assert settings.mode == "local"
    assert settings.metrics_interval == 1.0
    assert settings.max_gpus_per_request == 8
    assert settings.agent_client_class is AsyncAgentClient
    assert settings.kernel_sandboxes_class is ProvisionerSandboxes


def test_inside_a_pod_the_mode_is_kubernetes(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(KUBERNETES_ENV, "10.96.0.1")

    assert GPUHotplug().mode == "kubernetes"


def test_mode_variable_beats_the_guess_and_config_beats_both(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv(KUBERNETES_ENV, "10.96.0.1")
    clean_env.setenv(MODE_ENV, "local")

    assert GPUHotplug().mode == "local"
    assert GPUHotplug(config=Config({"GPUHotplug": {"mode": "kubernetes"}})).mode == "kubernetes"


@pytest.mark.parametrize(
    ("trait", "value", "words"),
    [
        ("metrics_interval", 0, "metrics_interval must be"),
        ("metrics_interval", -1, "metrics_interval must be"),
        ("metrics_interval", 3601, "metrics_interval must be"),
        ("max_gpus_per_request", 0, "max_gpus_per_request must be"),
        ("max_gpus_per_request", 256, "max_gpus_per_request must be"),
        ("mode", "cluster", "mode"),
        ("agent_client_class", AgentClient, "agent_client_class"),
        ("kernel_sandboxes_class", object, "kernel_sandboxes_class"),
    ],
)
def test_invalid_values_are_refused(trait: str, value: Any, words: str) -> None:
    with pytest.raises(TraitError, match=words):
        GPUHotplug(**{trait: value})


def test_swappable_classes_accept_subclasses_and_import_strings() -> None:
    settings = GPUHotplug(
        agent_client_class="tests.server.api_support.BrokenClient",
        kernel_sandboxes_class=RegisteredSandboxes,
    )

    assert settings.agent_client_class is BrokenClient
    assert settings.kernel_sandboxes_class is RegisteredSandboxes


def test_describe_names_every_setting(clean_env: pytest.MonkeyPatch) -> None:
    text = GPUHotplug(metrics_interval=0.5).describe()

    for part in ("mode=local", "metrics_interval=0.5s", "max_gpus_per_request=8", "agent_url="):
        assert part in text


class TestWiring:
    @pytest.fixture
    def jp_server_config(self, jp_server_config: Config) -> Config:
        settings = jp_server_config.GPUHotplug
        settings.agent_url = "unix:/nonexistent/agent.sock"
        settings.mode = "kubernetes"
        settings.metrics_interval = 2.5
        settings.max_gpus_per_request = 3
        settings.request_timeout = 7
        return jp_server_config

    def test_the_manager_is_built_from_the_settings(self, jp_serverapp: ServerApp) -> None:
        manager = manager_of(jp_serverapp)

        assert (manager.mode, manager.interval, manager.max_count) == ("kubernetes", 2.5, 3)
        assert manager.client.agent_url == "unix:/nonexistent/agent.sock"
        assert manager.client.timeouts.read == 7
        assert isinstance(manager.sandboxes, ProvisionerSandboxes)
        assert manager.sandboxes.kernel_manager is jp_serverapp.kernel_manager

    async def test_stopping_the_extension_closes_the_manager(
        self, jp_serverapp: ServerApp, jp_fetch: Fetch
    ) -> None:
        (app,) = jp_serverapp.extension_manager.extension_apps[GPUHotplugApp.name]
        assert isinstance(app, GPUHotplugApp)

        await app.stop_extension()
        await app.stop_extension()  # idempotent: the server may stop it again at exit

        reply = await call(jp_fetch, "GET", "gpus")
        reply.error(503, "shutting_down")
