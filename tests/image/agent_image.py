"""The agent's image, built by ``image/build.sh`` (the one way to build it) for tests that run
it: its own test here and the real node's deployment test, which imports the archive into the
node's containerd.

Podman keeps this build's storage in a directory of its own (never the machine's), removed with
``podman system reset`` when the process ends; the Debian base's tarball stays cached by
``build.sh`` (``images.py`` builds every kind).
"""

from __future__ import annotations

import functools

from .images import BUILD_TIMEOUT, BuiltImage, build_in_private_storage

AgentImage = BuiltImage

__all__ = ["BUILD_TIMEOUT", "AgentImage", "agent_image"]


@functools.cache
def agent_image() -> AgentImage:
    """The image of this source tree, built once per test session."""
    return build_in_private_storage("agent")
