"""The agent's container image for the real node's deployment test: built by
``image/build.sh`` (``tests/image/agent_image.py`` runs it), the one way the project builds the
image — a Debian base made by ``mmdebstrap``, ``podman build`` of ``image/Containerfile`` with
no registry — and imported into the node's containerd from its OCI archive.
"""

from __future__ import annotations

from ..image.agent_image import AgentImage, agent_image

__all__ = ["AgentImage", "agent_image"]
