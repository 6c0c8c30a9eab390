"""The demo's JupyterLab configuration: sandboxed kernels wired to the demo's agent."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from traitlets.config.loader import JSONFileConfigLoader

from jupyter_gpu_hotplug.client import AGENT_URL_ENV
from jupyter_gpu_hotplug.demo.labconfig import (
    NEWS_OFF_OVERRIDES,
    SANDBOX_NAME_PREFIX,
    LabSettings,
    SimulatedNvml,
    kernel_environment,
    lab_config,
    lab_url,
    server_environment,
    write_lab_config,
    write_lab_files,
)
from jupyter_gpu_hotplug.demo.layout import DemoLayout
from jupyter_gpu_hotplug.nvml.sim import CONFIG_ENV, DEVICE_FILTER_ENV
from jupyter_gpu_hotplug.sandboxes.provisioner import PROVISIONER_NAME

ROOT = Path("/tmp/demo-x")
NOTEBOOKS = Path("/home/u/work")
BIN = str(Path(sys.executable).parent)
NVML = SimulatedNvml(library_dir=ROOT / "nvml/lib", config_path=ROOT / "simulation/fake.conf")


def settings(*, nvml: SimulatedNvml | None = NVML, ip: str = "127.0.0.1") -> LabSettings:
    return LabSettings(
        ip=ip, port=9999, token="t0ken", layout=DemoLayout(ROOT, NOTEBOOKS), nvml=nvml
    )


def test_simulated_kernels_reach_the_agent_and_see_gpus_through_their_dev() -> None:
    env = kernel_environment(
        settings(), inherited={"LD_LIBRARY_PATH": "/opt/lib", "HOME": "/x", "PATH": "/usr/bin"}
    )
    assert env == {
        AGENT_URL_ENV: f"unix:{ROOT}/agent.sock",
        "PATH": f"{BIN}:/usr/bin",
        "LD_LIBRARY_PATH": f"{ROOT}/nvml/lib:/opt/lib",
        CONFIG_ENV: f"{ROOT}/simulation/fake.conf",
        DEVICE_FILTER_ENV: "/dev",
    }


def test_simulated_kernels_find_the_simulated_nvidia_smi_first() -> None:
    tools = ROOT / "simulation-tools"
    nvml = dataclasses.replace(NVML, tools_dir=tools)
    path = kernel_environment(settings(nvml=nvml), inherited={"PATH": "/usr/bin"})["PATH"]
    assert path == f"{tools}:{BIN}:/usr/bin"


def test_kernels_with_real_gpus_only_get_the_agent_and_their_python() -> None:
    assert kernel_environment(settings(nvml=None), inherited={"PATH": "/bin"}) == {
        AGENT_URL_ENV: f"unix:{ROOT}/agent.sock",
        "PATH": f"{BIN}:/bin",
    }


def test_python_in_a_kernel_shell_is_the_kernel_interpreter_whatever_sudo_left() -> None:
    """``sudo`` resets PATH to the system's; ``!python`` must still be this interpreter."""
    path = kernel_environment(settings(), inherited={"PATH": "/usr/sbin:/usr/bin"})["PATH"]
    first = path.split(os.pathsep)[0]
    assert Path(first, "python").resolve() == Path(sys.executable).resolve()
    assert kernel_environment(settings(), inherited={})["PATH"] == f"{BIN}:{os.defpath}"


def test_the_server_sees_every_simulated_gpu_and_is_no_agent_client_itself() -> None:
    env = server_environment(settings(), inherited={AGENT_URL_ENV: "unix:/elsewhere", "A": "b"})
    assert env["A"] == "b"
    assert AGENT_URL_ENV not in env, "terminals must not pass for kernels"
    assert env["JUPYTER_RUNTIME_DIR"] == f"{ROOT}/jupyterlab/runtime"
    assert env["JUPYTER_PATH"] == f"{ROOT}/jupyterlab/data", "the demo's kernel spec first"
    kept = server_environment(settings(), inherited={"JUPYTER_PATH": "/opt/j"})["JUPYTER_PATH"]
    assert kept == f"{ROOT}/jupyterlab/data:/opt/j"
    assert env[CONFIG_ENV] == f"{ROOT}/simulation/fake.conf"
    assert DEVICE_FILTER_ENV not in env
    assert CONFIG_ENV not in server_environment(settings(nvml=None), inherited={})


def test_every_kernel_is_sandboxed_with_the_kernel_environment() -> None:
    config = lab_config(settings())
    assert config["KernelProvisionerFactory"] == {"default_provisioner_name": PROVISIONER_NAME}
    assert config["SandboxedKernelProvisioner"] == {
        "extra_env": kernel_environment(settings()),
        "name_prefix": SANDBOX_NAME_PREFIX,
        # The default hidden paths and the demo agent's state (its token and ledger).
        "hidden_paths": ["/var/lib/gpu-hotplug", f"{ROOT}/agent"],
    }


def test_the_server_listens_where_asked_with_a_token_and_the_extension() -> None:
    config = lab_config(settings(ip="0.0.0.0"))
    assert config["ServerApp"] == {
        "ip": "0.0.0.0",
        "port": 9999,
        "port_retries": 0,
        "open_browser": False,
        "allow_root": True,
        "root_dir": str(NOTEBOOKS),
        "jpserver_extensions": {"jupyter_gpu_hotplug": True},
    }
    assert config["IdentityProvider"] == {"token": "t0ken"}
    # Workspaces stay with the run, not in the user's ~/.jupyter (issue 36, item 9).
    assert config["LabApp"] == {
        "app_settings_dir": f"{ROOT}/jupyterlab/settings",
        "workspaces_dir": f"{ROOT}/jupyterlab/workspaces",
    }
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


def test_lab_files_silence_the_news_prompt_and_load_the_magic_in_every_kernel(
    tmp_path: Path,
) -> None:
    layout = DemoLayout(tmp_path / "state", tmp_path / "notebooks")
    layout.prepare()
    write_lab_files(LabSettings(ip="127.0.0.1", port=9999, token="t", layout=layout, nvml=None))
    overrides = json.loads((layout.lab_settings / "overrides.json").read_text())
    assert overrides == NEWS_OFF_OVERRIDES
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    spec = json.loads(layout.kernelspec.read_text())
    assert spec["argv"][:3] == [sys.executable, "-m", "ipykernel_launcher"]
    assert "--ext=jupyter_gpu_hotplug" in spec["argv"]
    assert layout.kernelspec == layout.lab_data / "kernels" / "python3" / "kernel.json"
    assert stat.S_IMODE(layout.lab_config.stat().st_mode) == 0o600
