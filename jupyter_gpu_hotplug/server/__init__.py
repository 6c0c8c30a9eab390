"""The jupyter_server extension: REST handlers under ``<base_url>/gpu-hotplug/api/``.

This package is the browser's way in. It stays thin on purpose: handlers authenticate, parse,
delegate and answer JSON; everything about talking to the node agent belongs elsewhere, so the
``%gpu`` magic and the command line behave exactly like the toolbar.
"""

from __future__ import annotations

from .app import GPUHotplugApp
from .config import GPUHotplug

__all__ = ["GPUHotplug", "GPUHotplugApp"]
