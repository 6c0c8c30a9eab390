"""jupyter-gpu-hotplug: attach and release GPUs in a running Jupyter container.

The public entry points Jupyter looks for live here and import their pieces
lazily, so that ``import jupyter_gpu_hotplug`` stays cheap inside every kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__all__ = ["__version__", "load_ipython_extension"]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    """Tell jupyter_server which ExtensionApp to load (see ``etc/jupyter_server_config.d``)."""
    from .server.app import GPUHotplugApp

    return [{"module": "jupyter_gpu_hotplug.server.app", "app": GPUHotplugApp}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where ``jupyter labextension develop`` finds the built frontend."""
    return [{"src": "labextension", "dest": "jupyter-gpu-hotplug"}]


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """``%load_ext jupyter_gpu_hotplug``: register the ``%gpu`` magic."""
    from .kernel.magic import register

    register(ipython)
