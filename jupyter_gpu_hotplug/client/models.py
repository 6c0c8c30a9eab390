"""The agent's answers as typed values: ``Gpu``, ``Attachment``, ``Health``.

Boundary: pure parsing of already-decoded JSON into frozen dataclasses. No I/O.

Why it exists: frontends should not poke at dicts, and an answer that does not have the
contract's shape (DESIGN §3, ``_structs``) must fail here, with the JSON path at fault, instead
of as a ``KeyError`` somewhere in a widget. Parsing is a *tolerant reader*: members a newer
agent adds are ignored; missing or mistyped required members are errors (``ValueError``, turned
into ``AgentProtocolError`` by the client). The wire dict stays available as ``raw``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final, TypeVar, cast, get_args

from .._structs import (
    Attachment as AttachmentWire,
)
from .._structs import (
    GpuInfo,
    GpuState,
    GpuUuid,
    TargetRef,
    TargetWire,
    parse_timestamp,
    target_from_wire,
)

__all__ = ["Attachment", "Gpu", "Health", "parse_attachments", "parse_gpus", "parse_health"]

_GPU_STATES: Final[frozenset[str]] = frozenset(get_args(GpuState))
_T = TypeVar("_T")


def _member(obj: Mapping[str, object], key: str, kind: type[_T], where: str) -> _T:
    if key not in obj:
        raise ValueError(f"{where}.{key} is missing")
    value = obj[key]
    # bool is an int to isinstance, never to the contract.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}.{key} must be {kind.__name__}, not {type(value).__name__}")
    return value


def _object(value: object, where: str) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object, not {type(value).__name__}")
    return cast("Mapping[str, object]", value)


def _list(obj: Mapping[str, object], key: str, where: str) -> list[object]:
    return cast("list[object]", _member(obj, key, list, where))


def _target(value: object, where: str) -> TargetRef:
    wire = _object(value, where)
    try:
        return target_from_wire(cast(TargetWire, wire))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where} is not a target: {error}") from error


@dataclass(frozen=True)
class Gpu:
    """One GPU of the node, as ``GET /v1/gpus`` lists it."""

    uuid: GpuUuid
    index: int
    """NVML index on the node (not inside a container)."""
    minor: int
    """Driver minor: the device is ``/dev/nvidia<minor>``."""
    name: str
    memory_total: int
    """Bytes."""
    state: GpuState
    """``free``; ``attached``: hot-attached by the agent; ``allocated``: held by a pod through
    the device plugin."""
    target: TargetRef | None
    """Who has it, when attached."""
    simulated: bool
    raw: GpuInfo = field(repr=False, compare=False)
    """The wire object, as received."""

    @property
    def device(self) -> str:
        return f"/dev/nvidia{self.minor}"

    @classmethod
    def from_wire(cls, value: object, *, where: str = "gpu") -> Gpu:
        """Check and convert one ``GpuInfo``; ``ValueError`` names the member at fault."""
        wire = _object(value, where)
        state = _member(wire, "state", str, where)
        if state not in _GPU_STATES:
            raise ValueError(f"{where}.state {state!r} is not one of {sorted(_GPU_STATES)}")
        target = _member(wire, "target", object, where)
        return cls(
            uuid=GpuUuid(_member(wire, "uuid", str, where)),
            index=_member(wire, "index", int, where),
            minor=_member(wire, "minor", int, where),
            name=_member(wire, "name", str, where),
            memory_total=_member(wire, "memory_total", int, where),
            state=cast(GpuState, state),
            target=None if target is None else _target(target, f"{where}.target"),
            simulated=_member(wire, "simulated", bool, where),
            raw=cast(GpuInfo, wire),
        )


@dataclass(frozen=True)
class Attachment:
    """A GPU hot-attached to a target, as ``/v1/attachments`` reports it."""

    uuid: GpuUuid
    index: int
    minor: int
    name: str
    device: str
    """The device node inside the target, ``/dev/nvidia<minor>``."""
    target: TargetRef
    holder: str | None
    """``namespace/name`` of the holder pod that reserves the GPU; ``None`` in local mode."""
    attached_at: datetime
    """Timezone-aware, UTC."""
    raw: AttachmentWire = field(repr=False, compare=False)
    """The wire object, as received."""

    @classmethod
    def from_wire(cls, value: object, *, where: str = "attachment") -> Attachment:
        """Check and convert one ``Attachment``; ``ValueError`` names the member at fault."""
        wire = _object(value, where)
        holder = _member(wire, "holder", object, where)
        if holder is not None and not isinstance(holder, str):
            raise ValueError(f"{where}.holder must be str or null, not {type(holder).__name__}")
        stamp = _member(wire, "attached_at", str, where)
        try:
            attached_at = parse_timestamp(stamp)
        except ValueError as error:
            raise ValueError(f"{where}.attached_at: {error}") from error
        return cls(
            uuid=GpuUuid(_member(wire, "uuid", str, where)),
            index=_member(wire, "index", int, where),
            minor=_member(wire, "minor", int, where),
            name=_member(wire, "name", str, where),
            device=_member(wire, "device", str, where),
            target=_target(_member(wire, "target", object, where), f"{where}.target"),
            holder=holder,
            attached_at=attached_at,
            raw=cast(AttachmentWire, wire),
        )


@dataclass(frozen=True)
class Health:
    """``GET /healthz``: the agent process is alive (says nothing about GPUs)."""

    status: str


def parse_gpus(value: object) -> tuple[Gpu, ...]:
    """The body of ``GET /v1/gpus``."""
    body = _object(value, "body")
    return tuple(
        Gpu.from_wire(item, where=f"gpus[{i}]")
        for i, item in enumerate(_list(body, "gpus", "body"))
    )


def parse_attachments(value: object) -> tuple[Attachment, ...]:
    """The body of ``GET /v1/attachments`` and of a ``201`` from ``POST /v1/attachments``."""
    body = _object(value, "body")
    return tuple(
        Attachment.from_wire(item, where=f"attachments[{i}]")
        for i, item in enumerate(_list(body, "attachments", "body"))
    )


def parse_health(value: object) -> Health:
    """The body of ``GET /healthz``."""
    return Health(status=_member(_object(value, "body"), "status", str, "body"))
