"""The user-facing settings of the notebook side, as the ``GPUHotplug`` traitlets section.

Why a Configurable of its own rather than traits on the ExtensionApp: users write
``c.GPUHotplug.agent_url = ...`` (the section name is the class name), and the settings describe
*how to reach the agent*, not how the server extension runs. Owning them in a separate object —
the way ``ServerApp`` owns ``IdentityProvider`` or ``KernelManager`` — keeps that section stable
if the app class is renamed and lets the app hand the object to collaborators.

Precedence, highest first: command line (``--GPUHotplug.agent_url=...``), Jupyter config files,
the environment variables the spawner sets, the built-in defaults. The environment is read here,
in trait defaults, and nowhere deeper.
"""

from __future__ import annotations

import os
from typing import Any

from traitlets import Enum, Float, Int, TraitError, Type, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from ..client import AGENT_URL_ENV, DEFAULT_AGENT_URL, TOKEN_PATH_ENV, AsyncAgentClient
from .kernel_sandboxes import KernelSandboxes, ProvisionerSandboxes

MODE_ENV = "GPU_HOTPLUG_MODE"
"""``local`` or ``kubernetes``; overrides the guess from the environment."""
KUBERNETES_ENV = "KUBERNETES_SERVICE_HOST"
"""Set by the kubelet in every pod: its presence means the server runs in Kubernetes."""
MODES = ("local", "kubernetes")


class GPUHotplug(LoggingConfigurable):
    """How the notebook side reaches the node agent."""

    agent_url = Unicode(
        help=f"""URL of the node agent: ``http(s)://host:port`` or ``unix:/path/to/agent.sock``.

        Defaults to the environment variable ``{AGENT_URL_ENV}`` (set by the JupyterHub
        spawner), else to the local-mode socket ``{DEFAULT_AGENT_URL}``.""",
    ).tag(config=True)

    token_path = Unicode(
        help=f"""File holding the bearer token sent to the agent; empty sends no token.

        In Kubernetes this is the projected service-account token (audience ``gpu-hotplug``).
        The file is re-read on every request because the kubelet rotates it. Defaults to the
        environment variable ``{TOKEN_PATH_ENV}``, else empty (local mode over a unix socket
        identifies the caller by its peer credentials instead).""",
    ).tag(config=True)

    request_timeout = Float(
        30.0,
        help="""Seconds to wait for one agent request before giving up.

        An attach that waits for a GPU to become free passes its own, longer wait to the agent;
        this bounds the plain round trip.""",
    ).tag(config=True)

    mode = Enum(
        MODES,
        help=f"""Where attached GPUs go. ``local``: to one kernel's sandbox (requests name
        the kernel; kernels run under the sandbox kernel provisioner, as in ``jupyter
        gpu-hotplug demo``). ``kubernetes``: to this notebook's pod, which the agent
        identifies from the pod's token (every kernel of the pod shares its GPUs).

        Defaults to the environment variable ``{MODE_ENV}``, else ``kubernetes`` inside a
        pod (``{KUBERNETES_ENV}`` is set), else ``local``.""",
    ).tag(config=True)

    metrics_interval = Float(
        1.0,
        help="""Seconds between two ``metrics`` events of the live stream (and between two
        ``waiting`` events of an attach in flight). Each event reads NVML and asks the agent
        twice, so very small values cost CPU in this server and in the agent.""",
    ).tag(config=True)

    max_gpus_per_request = Int(
        8,
        help="""The most GPUs one attach request may ask for; larger requests are refused
        with 400 before the agent is asked. The agent applies its own per-target limit too.""",
    ).tag(config=True)

    agent_client_class = Type(
        default_value=AsyncAgentClient,
        klass=AsyncAgentClient,
        help="""The agent client class (a subclass of ``AsyncAgentClient``), constructed with
        the agent URL, the token path and the request timeout.""",
    ).tag(config=True)

    kernel_sandboxes_class = Type(
        default_value=ProvisionerSandboxes,
        klass=KernelSandboxes,
        help="""How a kernel id becomes the pid of the kernel's sandbox in local mode (a
        subclass of ``KernelSandboxes``). The default asks the kernel's provisioner for its
        ``sandbox_pid``, which the sandbox kernel provisioner offers.""",
    ).tag(config=True)

    @default("mode")
    def _mode_default(self) -> str:
        chosen = os.environ.get(MODE_ENV)
        if chosen:
            return chosen
        return "kubernetes" if os.environ.get(KUBERNETES_ENV) else "local"

    @validate("metrics_interval")
    def _validate_metrics_interval(self, proposal: dict[str, Any]) -> float:
        value = float(proposal["value"])
        if not 0 < value <= 3600:
            raise TraitError(
                f"GPUHotplug.metrics_interval must be from 0 to 3600 seconds (not 0), got {value!r}"
            )
        return value

    @validate("max_gpus_per_request")
    def _validate_max_gpus(self, proposal: dict[str, Any]) -> int:
        value = int(proposal["value"])
        if not 1 <= value <= 255:
            raise TraitError(f"GPUHotplug.max_gpus_per_request must be 1 to 255, got {value}")
        return value

    @default("agent_url")
    def _agent_url_default(self) -> str:
        # An empty variable means "not set": spawners template it and may leave it blank.
        return os.environ.get(AGENT_URL_ENV) or DEFAULT_AGENT_URL

    @default("token_path")
    def _token_path_default(self) -> str:
        return os.environ.get(TOKEN_PATH_ENV, "")

    @validate("request_timeout")
    def _validate_request_timeout(self, proposal: dict[str, Any]) -> float:
        value = float(proposal["value"])
        if not value > 0:
            raise TraitError(f"GPUHotplug.request_timeout must be positive seconds, got {value!r}")
        return value

    def describe(self) -> str:
        """One log-friendly line with the resolved values, for start-up logs and bug reports."""
        return (
            f"mode={self.mode} agent_url={self.agent_url!r} "
            f"token_path={self.token_path or '(none)'!r} "
            f"request_timeout={self.request_timeout:g}s "
            f"metrics_interval={self.metrics_interval:g}s "
            f"max_gpus_per_request={self.max_gpus_per_request}"
        )
