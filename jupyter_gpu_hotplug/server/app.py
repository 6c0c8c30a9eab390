"""The jupyter_server ``ExtensionApp`` that mounts our REST handlers.

It exists to be the one place where the server extension is wired: it owns the ``GPUHotplug``
settings object, logs what those settings resolved to, and registers the handlers listed in
``handlers.default_handlers`` — unconditionally, because GPUs come and go while the server runs
and the inventory is asked for when needed, never frozen at load time.
"""

from __future__ import annotations

from jupyter_server.extension.application import ExtensionApp
from traitlets import Instance, default
from traitlets.config.application import ClassesType

from .._version import __version__
from .config import GPUHotplug
from .handlers import default_handlers


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

    def initialize_settings(self) -> None:
        self.log.info("jupyter-gpu-hotplug %s: %s", __version__, self.hotplug_config.describe())

    def initialize_handlers(self) -> None:
        self.handlers.extend(default_handlers)
