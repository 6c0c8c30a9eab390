"""The demo's JupyterLab configuration: sandboxed kernels wired to the demo's agent."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from traitlets.config.loader import JSONFileConfigLoader

from jupyter_gpu_hotplug.client import AGENT_URL_ENV
from jupyter_gpu_hotplug.demo.labconfig import (
    SANDBOX_NAME_PREFIX,
    LabSettings,
    SimulatedNvml,
    kernel_environment,
    lab_config,
    lab_url,
    server_environment,
    write_lab_config,
)
from jupyter_gpu_hotplug.demo.layout import DemoLayout
from jupyter_gpu_hotplug.nvml.sim import CONFIG_ENV, DEVICE_FILTER_ENV
from jupyter_gpu_hotplug.sandboxes.provisioner import PROVISIONER_NAME

ROOT = Path("/tmp/demo-x")
NVML = SimulatedNvml(library_dir=ROOT / "nvml/lib", config_path=ROOT / "simulation/fake.conf")


def settings(*, nvml: SimulatedNvml | None = NVML, ip: str = "127.0.0.1") -> LabSettings:
    return LabSettings(ip=ip, port=9999, token="t0ken", layout=DemoLayout(ROOT), nvml=nvml)


def test_simulated_kernels_reach_the_agent_and_see_gpus_through_their_dev() -> None:
    env = kernel_environment(settings(), inherited={"LD_LIBRARY_PATH": "/opt/lib", "HOME": "/x"})
    assert env == {
        AGENT_URL_ENV: f"unix:{ROOT}/agent.sock",
        "LD_LIBRARY_PATH": f"{ROOT}/nvml/lib:/opt/lib",
        CONFIG_ENV: f"{ROOT}/simulation/fake.conf",
        DEVICE_FILTER_ENV: "/dev",
    }


def test_kernels_with_real_gpus_only_get_the_agent() -> None:
    assert kernel_environment(settings(nvml=None)) == {AGENT_URL_ENV: f"unix:{ROOT}/agent.sock"}


def test_the_server_sees_every_simulated_gpu_and_is_no_agent_client_itself() -> None:
    env = server_environment(settings(), inherited={AGENT_URL_ENV: "unix:/elsewhere", "A": "b"})
    assert env["A"] == "b"
    assert AGENT_URL_ENV not in env, "terminals must not pass for kernels"
    assert env["JUPYTER_RUNTIME_DIR"] == f"{ROOT}/jupyterlab/runtime"
    assert env[CONFIG_ENV] == f"{ROOT}/simulation/fake.conf"
    assert DEVICE_FILTER_ENV not in env
    assert CONFIG_ENV not in server_environment(settings(nvml=None), inherited={})


def test_every_kernel_is_sandboxed_with_the_kernel_environment() -> None:
    config = lab_config(settings())
    assert config["KernelProvisionerFactory"] == {"default_provisioner_name": PROVISIONER_NAME}
    assert config["SandboxedKernelProvisioner"] == {
        "extra_env": kernel_environment(settings()),
        "name_prefix": SANDBOX_NAME_PREFIX,
    }


def test_the_server_listens_where_asked_with_a_token_and_the_extension() -> None:
    config = lab_config(settings(ip="0.0.0.0"))
    assert config["ServerApp"] == {
        "ip": "0.0.0.0",
        "port": 9999,
        "port_retries": 0,
        "open_browser": False,
        "allow_root": True,
        "root_dir": f"{ROOT}/notebooks",
        "jpserver_extensions": {"jupyter_gpu_hotplug": True},
    }
    assert config["IdentityProvider"] == {"token": "t0ken"}
    assert config["GPUHotplug"] == {
        "agent_url": f"unix:{ROOT}/agent.sock",
        "token_path": f"{ROOT}/agent/token",
    }


def test_the_config_file_is_private_and_loads_as_jupyter_config(tmp_path: Path) -> None:
    path = tmp_path / "demo_config.json"
    write_lab_config(path, lab_config(settings()))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = JSONFileConfigLoader(path.name, path=str(tmp_path)).load_config()
    assert loaded.IdentityProvider.token == "t0ken"
    assert loaded.SandboxedKernelProvisioner.extra_env[DEVICE_FILTER_ENV] == "/dev"


@pytest.mark.parametrize(
    ("ip", "host"),
    [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::", "[::1]"), ("::1", "[::1]")],
)
def test_the_url_opens_the_starter_notebook_with_the_token(ip: str, host: str) -> None:
    assert lab_url(settings(ip=ip)) == (
        f"http://{host}:9999/lab/tree/gpu-hotplug-starter.ipynb?token=t0ken"
    )
    assert lab_url(settings(ip=ip), path="api/status").startswith(f"http://{host}:9999/api/status?")
