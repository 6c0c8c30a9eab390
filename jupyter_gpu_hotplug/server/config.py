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

from traitlets import Float, TraitError, Unicode, default, validate
from traitlets.config import LoggingConfigurable

AGENT_URL_ENV = "GPU_HOTPLUG_AGENT_URL"
"""Set by the spawner to the node agent's URL."""
TOKEN_PATH_ENV = "GPU_HOTPLUG_TOKEN_PATH"
"""Set by the spawner to the projected service-account token's path."""
DEFAULT_AGENT_URL = "unix:/run/gpu-hotplug/agent.sock"
"""The local-mode agent's socket (see DESIGN §3, local mode)."""


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
            f"agent_url={self.agent_url!r} token_path={self.token_path or '(none)'!r} "
            f"request_timeout={self.request_timeout:g}s"
        )
