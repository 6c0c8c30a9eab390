"""The extension app: settings resolution (config > environment > default) and start-up."""

from __future__ import annotations

import pytest
from jupyter_server.serverapp import ServerApp
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpu_hotplug.client import AGENT_URL_ENV, DEFAULT_AGENT_URL, TOKEN_PATH_ENV
from jupyter_gpu_hotplug.server import GPUHotplug, GPUHotplugApp


def test_defaults_without_environment(clean_env: pytest.MonkeyPatch) -> None:
    settings = GPUHotplug()

    assert settings.agent_url == DEFAULT_AGENT_URL
    assert settings.token_path == ""
    assert settings.request_timeout == 30.0


def test_environment_from_the_spawner_is_the_default(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(AGENT_URL_ENV, "http://10.0.0.7:8765")
    clean_env.setenv(TOKEN_PATH_ENV, "/var/run/secrets/gpu-hotplug/token")

    settings = GPUHotplug()

    assert settings.agent_url == "http://10.0.0.7:8765"
    assert settings.token_path == "/var/run/secrets/gpu-hotplug/token"


def test_empty_agent_url_variable_means_unset(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(AGENT_URL_ENV, "")

    assert GPUHotplug().agent_url == DEFAULT_AGENT_URL


def test_config_beats_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(AGENT_URL_ENV, "http://from-env:1")
    config = Config({"GPUHotplug": {"agent_url": "http://from-config:2", "request_timeout": 5}})

    settings = GPUHotplug(config=config)

    assert settings.agent_url == "http://from-config:2"
    assert settings.request_timeout == 5.0


@pytest.mark.parametrize("timeout", [0, -1.5, float("nan")])
def test_request_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(TraitError, match="request_timeout must be positive"):
        GPUHotplug(request_timeout=timeout)


def test_every_setting_is_documented() -> None:
    for name, trait in GPUHotplug.class_traits(config=True).items():
        assert trait.help and len(trait.help) > 40, f"GPUHotplug.{name} needs a real help="


def _our_app(server: ServerApp) -> GPUHotplugApp:
    (app,) = server.extension_manager.extension_apps[GPUHotplugApp.name]
    assert isinstance(app, GPUHotplugApp)
    return app


class TestLoadedIntoServer:
    @pytest.fixture
    def jp_server_config(self, jp_server_config: Config) -> Config:
        jp_server_config.GPUHotplug.agent_url = "http://agent.example:8765"
        jp_server_config.GPUHotplug.token_path = "/tmp/token"
        return jp_server_config

    def test_server_config_reaches_the_settings(self, jp_serverapp: ServerApp) -> None:
        settings = _our_app(jp_serverapp).hotplug_config

        assert settings.agent_url == "http://agent.example:8765"
        assert settings.token_path == "/tmp/token"

    def test_resolved_settings_are_logged_at_start(
        self, capsys: pytest.CaptureFixture[str], jp_serverapp: ServerApp
    ) -> None:
        err = capsys.readouterr().err

        assert "agent_url='http://agent.example:8765'" in err
        assert "token_path='/tmp/token'" in err
