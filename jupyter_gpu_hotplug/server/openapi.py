"""The server extension's OpenAPI document (``openapi.json`` beside this module), as one
server serves it.

Why rendered: two rules of this API are this server's configuration, not the contract's —
the most GPUs one attach may ask for (``GPUHotplug.max_gpus_per_request``) and, in local mode,
that every operation names its kernel — and a document that left them out would call requests
valid that the server refuses (schemathesis' positive-data check finds exactly that). So the
served document states them: ``count.maximum``, and ``kernel_id`` among the required members
of the bodies that need it. No I/O beyond reading the packaged file once.
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from typing import Any, Final

from .models import Mode
from .targeting import kernel_required

__all__ = ["openapi_document"]

_NEEDS_A_KERNEL: Final = ("AttachBody", "DetachBody", "CancelBody")
"""The bodies whose operation acts on one kernel's sandbox in local mode."""


@functools.cache
def _template() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("openapi.json").read_text(encoding="utf-8")
    document: dict[str, Any] = json.loads(text)
    return document


def openapi_document(*, mode: Mode, max_count: int) -> bytes:
    """The document of this server: its ``max_count`` and its mode's required members."""
    document = copy.deepcopy(_template())
    schemas = document["components"]["schemas"]
    schemas["AttachBody"]["properties"]["count"]["maximum"] = max_count
    if kernel_required(mode):
        for name in _NEEDS_A_KERNEL:
            schemas[name]["required"].append("kernel_id")
    return json.dumps(document, indent=2, ensure_ascii=False).encode()
