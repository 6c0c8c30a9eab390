"""The node agent: attaches GPUs to running containers or processes on this node (DESIGN §2-§4).

Boundary: the agent never imports the notebook side (``server``, ``kernel``) and the notebook
side never imports the agent; both share only ``_structs`` (the wire shapes) and the contract
in ``openapi.json`` beside this file, which the agent serves at ``/v1/openapi.json``.

Importing the package stays cheap (no tornado, no Kubernetes client): submodules are imported
where they are used.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["openapi_document"]


def openapi_document() -> bytes:
    """The agent API's OpenAPI document, exactly as shipped (served at ``/v1/openapi.json``)."""
    return resources.files(__name__).joinpath("openapi.json").read_bytes()
