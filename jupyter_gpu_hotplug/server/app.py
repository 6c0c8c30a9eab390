"""The jupyter_server ``ExtensionApp`` that mounts our REST handlers.

It exists to be the one place where the server extension is wired: it owns the ``GPUHotplug``
settings object, logs what those settings resolved to, builds the ``HotplugManager`` from them
(the agent client, the kernel-sandbox lookup, the NVML monitor) and hands it to the handlers
through the web application's settings, registers the handlers listed in
``handlers.default_handlers`` — unconditionally, because GPUs come and go while the server runs
and the inventory is asked for when needed, never frozen at load time — and closes the manager
when the server stops (open streams end, attaches in flight are abandoned, NVML released).
"""

from __future__ import annotations

from jupyter_server.extension.application import ExtensionApp
from traitlets import Instance, default
from traitlets.config.application import ClassesType

from .._version import __version__
from ..client import Timeouts
from ..nvml.state import GpuMonitor
from .config import GPUHotplug
from .handlers import MANAGER_SETTING, default_handlers
from .kernel_sandboxes import KernelSandboxes
from .manager import HotplugManager
from .models import Mode


class GPUHotplugApp(ExtensionApp):
    """Loaded by jupyter_server through ``_jupyter_server_extension_points()``."""

    # Must equal the key under ``ServerApp.jpserver_extensions`` that enables us.
    name = "jupyter_gpu_hotplug"
    description = "Attach and release GPUs in a running Jupyter server."
    version = __version__

    # Listed so ``--help-all`` and config generation show the GPUHotplug section.
    # traitlets declares ``classes`` as a plain (instance-typed) list; ClassVar would clash.
    classes: ClassesType = [*ExtensionApp.classes, GPUHotplug]  # noqa: RUF012

    hotplug_config = Instance(
        GPUHotplug,
        help="The resolved ``GPUHotplug`` settings, configured from this app's config.",
    )

    @default("hotplug_config")
    def _hotplug_config_default(self) -> GPUHotplug:
        return GPUHotplug(parent=self)

    manager = Instance(
        HotplugManager,
        allow_none=True,
        help="The manager the handlers call; built from ``hotplug_config`` at start.",
    )

    def initialize_settings(self) -> None:
        settings = self.hotplug_config
        self.log.info("jupyter-gpu-hotplug %s: %s", __version__, settings.describe())
        assert self.serverapp is not None  # set by jupyter_server before settings are made
        client = settings.agent_client_class(
            settings.agent_url,
            token_path=settings.token_path or None,
            timeouts=Timeouts(read=settings.request_timeout),
        )
        # The trait holds a concrete subclass; mypy only sees the abstract base.
        sandboxes_class: type[KernelSandboxes] = settings.kernel_sandboxes_class  # type: ignore[type-abstract]
        mode: Mode = "kubernetes" if settings.mode == "kubernetes" else "local"
        self.manager = HotplugManager(
            client=client,
            sandboxes=sandboxes_class(kernel_manager=self.serverapp.kernel_manager),
            monitor=GpuMonitor(),
            mode=mode,
            interval=settings.metrics_interval,
            max_count=settings.max_gpus_per_request,
            log=self.log,
            notebooks=self._notebook_paths,
        )
        self.settings[MANAGER_SETTING] = self.manager

    async def _notebook_paths(self) -> dict[str, str]:
        """Kernel id → notebook path, from the server's sessions (how holders are named)."""
        assert self.serverapp is not None
        sessions = await self.serverapp.session_manager.list_sessions()
        return {
            session["kernel"]["id"]: session["path"]
            for session in sessions
            if session.get("kernel") and session.get("path")
        }

    def initialize_handlers(self) -> None:
        self.handlers.extend(default_handlers)

    async def stop_extension(self) -> None:
        if self.manager is not None:
            await self.manager.close()
