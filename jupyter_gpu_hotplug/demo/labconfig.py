"""JupyterLab's configuration for the demo, and the environment its kernels get.

Why it exists: the demo's JupyterLab differs from a plain one in a handful of settings that
must agree with the agent the runner started — every kernel sandboxed (the provisioner as the
default), kernels that reach the agent's socket as themselves, simulated NVML for kernels when
the GPUs are simulated, the server extension pointed at the same agent, a token. Building them
here, as plain data, keeps that agreement testable without starting anything.

A first hour without chores: the ``%gpu`` magic is loaded in every kernel (the demo's
``python3`` kernel spec passes ``--ext``, the way a platform would), ``python`` in a kernel's
shell (``!python train.py``) is the kernel's own interpreter (its directory comes first on the
kernel's ``PATH``; ``sudo`` would otherwise leave the system's), and JupyterLab does not cover
the page with its "news?" prompt (settings overrides).

The configuration is handed to ``jupyter lab --config=<file>`` rather than on the command line:
the file is private (0600), so the token never shows in ``ps``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..client import AGENT_URL_ENV
from ..nvml.sim import fake_nvml_environ
from .layout import STARTER_NOTEBOOK, DemoLayout

__all__ = [
    "IPYTHON_EXTENSION",
    "NEWS_OFF_OVERRIDES",
    "SANDBOX_NAME_PREFIX",
    "SERVER_EXTENSION",
    "LabSettings",
    "SimulatedNvml",
    "kernel_environment",
    "kernelspec",
    "lab_config",
    "lab_url",
    "server_environment",
    "write_lab_config",
    "write_lab_files",
]

SANDBOX_NAME_PREFIX: Final = "gpu-hotplug-demo"
"""First part of the demo kernels' sandbox cgroup names: tells them apart from other servers'."""
SERVER_EXTENSION: Final = "jupyter_gpu_hotplug"
IPYTHON_EXTENSION: Final = "jupyter_gpu_hotplug"
"""What ``%load_ext`` would load: the ``%gpu`` magic, loaded in every demo kernel."""
NEWS_OFF_OVERRIDES: Final = {
    "@jupyterlab/apputils-extension:notification": {
        "fetchNews": "false",
        "checkForUpdates": False,
    }
}
"""JupyterLab settings defaults (``overrides.json``) without the "news?" prompt and the update
check: the prompt covers the page on a first start."""
_RUNTIME_DIR_ENV: Final = "JUPYTER_RUNTIME_DIR"
_JUPYTER_PATH_ENV: Final = "JUPYTER_PATH"
_WILDCARD_HOSTS: Final = {"0.0.0.0": "127.0.0.1", "::": "::1", "*": "127.0.0.1"}


@dataclass(frozen=True)
class SimulatedNvml:
    """Where simulated kernels find their NVML: the fake library and the agent's GPU config."""

    library_dir: Path
    config_path: Path
    tools_dir: Path | None = None
    """Put first on the kernels' ``PATH``: the SIMULATED ``nvidia-smi`` (``nvml.sim.smi``)."""


@dataclass(frozen=True, kw_only=True)
class LabSettings:
    """What varies between two demo runs' JupyterLab."""

    ip: str
    port: int
    token: str
    layout: DemoLayout
    nvml: SimulatedNvml | None
    """``None`` when the GPUs are real (kernels then load the driver's NVML)."""


def kernel_environment(
    settings: LabSettings, *, inherited: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Variables added to every sandboxed kernel's environment (the provisioner's
    ``extra_env``).

    The agent URL makes ``%gpu`` in a kernel talk to the agent over its unix socket, where the
    agent knows the kernel by its process credentials: no token is given to kernels. With
    simulated GPUs, the fake NVML with the ``/dev`` filter lets a kernel see exactly the GPUs
    whose device nodes its sandbox has, like NVML in a container, and a SIMULATED
    ``nvidia-smi`` reading it comes first on the ``PATH``. ``inherited`` (default: this
    process's environment) supplies the ``PATH`` that follows the kernel interpreter's
    directory, and an existing ``LD_LIBRARY_PATH`` to keep behind the fake.
    """
    base = os.environ if inherited is None else inherited
    path = [str(Path(sys.executable).parent), base.get("PATH", os.defpath)]
    if settings.nvml is not None and settings.nvml.tools_dir is not None:
        path.insert(0, str(settings.nvml.tools_dir))
    env = {AGENT_URL_ENV: settings.layout.agent_url, "PATH": os.pathsep.join(path)}
    if settings.nvml is not None:
        kept = {"LD_LIBRARY_PATH": base["LD_LIBRARY_PATH"]} if "LD_LIBRARY_PATH" in base else {}
        env.update(
            fake_nvml_environ(
                settings.nvml.library_dir,
                settings.nvml.config_path,
                device_filter=Path("/dev"),
                base=kept,
            )
        )
    return env


def server_environment(
    settings: LabSettings, *, inherited: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The whole environment of the ``jupyter lab`` process.

    Its runtime dir is the demo's, so connection files go with the demo. With simulated GPUs
    the server process sees every simulated GPU through the fake NVML (no ``/dev`` filter: it
    is the host's view, used for metrics); the agent URL is deliberately *not* exported, so
    that a terminal opened in JupyterLab — which runs outside any sandbox — is not taken for a
    kernel by ``jupyter gpu-hotplug`` commands. The demo's data dir comes first on
    ``JUPYTER_PATH``, so its ``python3`` kernel spec is the one used.
    """
    base = dict(os.environ if inherited is None else inherited)
    base.pop(AGENT_URL_ENV, None)
    base[_RUNTIME_DIR_ENV] = str(settings.layout.lab_runtime)
    data_path = [str(settings.layout.lab_data)]
    if base.get(_JUPYTER_PATH_ENV):
        data_path.append(base[_JUPYTER_PATH_ENV])
    base[_JUPYTER_PATH_ENV] = os.pathsep.join(data_path)
    if settings.nvml is None:
        return base
    return fake_nvml_environ(
        settings.nvml.library_dir, settings.nvml.config_path, device_filter=None, base=base
    )


def lab_config(settings: LabSettings) -> dict[str, Any]:
    """The JupyterLab configuration (traitlets sections as a JSON-ready dict)."""
    from ..sandboxes.provisioner import sandboxed_kernels_config

    layout = settings.layout
    kernels = sandboxed_kernels_config(
        extra_env=kernel_environment(settings),
        name_prefix=SANDBOX_NAME_PREFIX,
        # The demo's agent keeps its token and ledger here: no kernel may read them.
        also_hidden=[str(layout.agent_state)],
    )
    config: dict[str, Any] = json.loads(json.dumps(kernels))
    config["ServerApp"] = {
        "ip": settings.ip,
        "port": settings.port,
        # Fail rather than move to another port: the URL the demo prints names this one.
        "port_retries": 0,
        "open_browser": False,
        "allow_root": True,
        "root_dir": str(layout.notebooks),
        "jpserver_extensions": {SERVER_EXTENSION: True},
    }
    config["LabApp"] = {
        "app_settings_dir": str(layout.lab_settings),
        "workspaces_dir": str(layout.lab_workspaces),
    }
    config["IdentityProvider"] = {"token": settings.token}
    config["GPUHotplug"] = {"agent_url": layout.agent_url, "token_path": str(layout.agent_token)}
    return config


def kernelspec() -> dict[str, Any]:
    """The demo's ``python3`` kernel spec: ipykernel in this interpreter, with the ``%gpu``
    magic loaded at start (``--ext``, as in ``docs/usage.md``). It names no provisioner: the
    server's default one sandboxes it."""
    return {
        "argv": [
            sys.executable,
            "-m",
            "ipykernel_launcher",
            "-f",
            "{connection_file}",
            f"--ext={IPYTHON_EXTENSION}",
        ],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        "metadata": {"debugger": True},
    }


def write_lab_files(settings: LabSettings) -> None:
    """Write everything JupyterLab reads from the demo's directory: the configuration, the
    settings overrides and the kernel spec (``OSError`` if that fails)."""
    layout = settings.layout
    layout.lab_runtime.mkdir(mode=0o700, exist_ok=True)
    write_lab_config(layout.lab_config, lab_config(settings))
    layout.lab_settings.mkdir(exist_ok=True)
    (layout.lab_settings / "overrides.json").write_text(json.dumps(NEWS_OFF_OVERRIDES, indent=1))
    layout.kernelspec.parent.mkdir(parents=True, exist_ok=True)
    layout.kernelspec.write_text(json.dumps(kernelspec(), indent=1))


def write_lab_config(path: Path, config: Mapping[str, Any]) -> None:
    """Write ``config`` as JSON, readable by root only (it holds the token)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        os.fchmod(file.fileno(), 0o600)
        json.dump(config, file, indent=1, sort_keys=True)


def lab_url(settings: LabSettings, *, path: str = f"lab/tree/{STARTER_NOTEBOOK}") -> str:
    """The URL that opens ``path`` (default: the starter notebook), token included.

    A wildcard listen address is replaced by loopback, which a browser on this machine
    can open.
    """
    host = _WILDCARD_HOSTS.get(settings.ip, settings.ip)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}/{path}?token={settings.token}"
