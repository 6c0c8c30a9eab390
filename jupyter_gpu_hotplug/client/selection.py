"""Which GPUs a person means by what they typed: a node index or the beginning of a UUID.

Boundary: pure; the ``%gpu`` magic and the ``jupyter gpu-hotplug`` command line both use it, so
``detach 0`` means the same everywhere. The number is the node's index — what ``nvidia-smi``
on the host, the GPU panel and ``%gpu list`` show — never the kernel's own CUDA index, which
differs as soon as a kernel holds a GPU other than the node's first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final, Protocol, TypeVar

__all__ = ["Selectable", "is_index", "normalise_selector", "select_gpus"]

_INDEX: Final = re.compile(r"[0-9]{1,4}")
_UUID_START: Final = re.compile(r"(?:GPU|MIG)-[0-9a-f][0-9a-f-]{0,35}")


class Selectable(Protocol):
    """A GPU as the agent lists it: its UUID and its index on the node."""

    @property
    def uuid(self) -> str: ...

    @property
    def index(self) -> int: ...


_G = TypeVar("_G", bound=Selectable)


def is_index(selector: str) -> bool:
    """Whether ``selector`` is a node index (plain digits) rather than a UUID."""
    return _INDEX.fullmatch(selector) is not None


def normalise_selector(text: str) -> str | None:
    """``text`` as a selector — a node index, or a UUID beginning in NVML's spelling
    (``GPU-``/``MIG-`` then lower-case hex) — or ``None`` when it is neither."""
    if is_index(text):
        return str(int(text))
    kind, dash, rest = text.partition("-")
    normalised = f"{kind.upper()}{dash}{rest.lower()}"
    return normalised if _UUID_START.fullmatch(normalised) else None


def select_gpus(selector: str, gpus: Iterable[_G]) -> list[_G]:
    """The ``gpus`` that a normalised ``selector`` names: the one with that node index, or
    every one whose UUID starts with it (the caller decides what several matches mean)."""
    if is_index(selector):
        return [gpu for gpu in gpus if gpu.index == int(selector)]
    return [gpu for gpu in gpus if gpu.uuid.startswith(selector)]
