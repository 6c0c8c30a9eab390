"""The agent's answers as typed values: ``Gpu``, ``Attachment``, ``Health``.

Boundary: pure parsing of already-decoded JSON into frozen dataclasses. No I/O.

Why it exists: frontends should not poke at dicts, and an answer that does not have the
contract's shape (DESIGN §3, ``_structs``) must fail here, with the JSON path at fault, instead
of as a ``KeyError`` somewhere in a widget. Parsing is a *tolerant reader*: members a newer
agent adds are ignored; missing or mistyped required members are errors (``ValueError``, turned
into ``AgentProtocolError`` by the client). The wire dict stays available as ``raw``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final, TypeVar, cast, get_args

from .._structs import (
    Attachment as AttachmentWire,
)
from .._structs import (
    GpuInfo,
    GpuKind,
    GpuState,
    GpuUuid,
    TargetRef,
    TargetWire,
    parse_timestamp,
    target_from_wire,
)

__all__ = [
    "Attachment",
    "AttachmentState",
    "Gpu",
    "Health",
    "IdleNotice",
    "IdleRelease",
    "LostHolderNotice",
    "QueuedRequest",
    "Suspension",
    "parse_attachment_state",
    "parse_attachments",
    "parse_gpus",
    "parse_health",
    "parse_idle_releases",
    "parse_queue",
    "plain_free",
    "plain_total",
]

_GPU_STATES: Final[frozenset[str]] = frozenset(get_args(GpuState))
_GPU_KINDS: Final[frozenset[str]] = frozenset(get_args(GpuKind))
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


def _items(obj: Mapping[str, object], key: str, kind: type[_T], where: str) -> tuple[_T, ...]:
    """A list member whose every item is a ``kind``."""
    items = _list(obj, key, where)
    return tuple(
        _member({f"{key}[{i}]": item}, f"{key}[{i}]", kind, where) for i, item in enumerate(items)
    )


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
    selectable: bool = False
    """An attach may name this GPU (``attach(gpus=...)``); an agent that does not say (one
    older than the member) cannot honour a named GPU, so a missing member reads as False."""
    kind: GpuKind = "gpu"
    """A whole GPU, a GPU in MIG mode or one of its slices (``_structs.GpuKind``), as the
    agent says. An agent older than the member does not say; it is read as ``gpu`` (whole):
    such an agent's list is taken as a list of whole GPUs."""
    plain_attach: bool = True
    """An attach of ``count`` alone may get it when free (``_structs.GpuInfo.plain_attach``):
    what ``plain_free`` counts. An agent older than the member does not say; read as True, as
    its GPUs are taken to be whole (on a node with MIG such an agent's count is too high)."""

    @property
    def device(self) -> str:
        return f"/dev/nvidia{self.minor}"

    @classmethod
    def from_wire(cls, value: object, *, where: str = "gpu") -> Gpu:
        """Check and convert one ``GpuInfo``; ``ValueError`` names the member at fault."""
        wire = _object(value, where)
        state = _one_of(wire, "state", _GPU_STATES, where)
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
            selectable="selectable" in wire and _member(wire, "selectable", bool, where),
            kind=_kind(wire, where),
            plain_attach="plain_attach" not in wire or _member(wire, "plain_attach", bool, where),
        )


def _one_of(wire: Mapping[str, object], key: str, choices: frozenset[str], where: str) -> str:
    value = _member(wire, key, str, where)
    if value not in choices:
        raise ValueError(f"{where}.{key} {value!r} is not one of {sorted(choices)}")
    return value


def _kind(wire: Mapping[str, object], where: str) -> GpuKind:
    return cast(GpuKind, _one_of(wire, "kind", _GPU_KINDS, where)) if "kind" in wire else "gpu"


def plain_free(gpus: Iterable[Gpu]) -> int:
    """How many of ``gpus`` an attach of ``count`` alone may get now: the free ones the agent
    says such an attach may get (``plain_attach``). A GPU in MIG mode never is, and a slice
    only where the agent hands out that profile alone; counting them made "N free" promise an
    "Attach 1 GPU" that fails. Every "N free" counts this."""
    return sum(1 for gpu in gpus if gpu.plain_attach and gpu.state == "free")


def plain_total(gpus: Iterable[Gpu]) -> int:
    """How many of ``gpus`` an attach of ``count`` alone may get, free or not: the most it
    could ever get, the "of N" beside ``plain_free``."""
    return sum(1 for gpu in gpus if gpu.plain_attach)


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
    idle_release: IdleNotice | None = None
    """Set while the agent's idle policy has announced this GPU's release."""
    holder_lost: LostHolderNotice | None = None
    """Set while the agent announces the revoke of this GPU: its holder pod was lost."""

    @classmethod
    def from_wire(cls, value: object, *, where: str = "attachment") -> Attachment:
        """Check and convert one ``Attachment``; ``ValueError`` names the member at fault."""
        wire = _object(value, where)
        holder = _member(wire, "holder", object, where)
        if holder is not None and not isinstance(holder, str):
            raise ValueError(f"{where}.holder must be str or null, not {type(holder).__name__}")
        attached_at = _stamp(wire, "attached_at", where)
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
            idle_release=IdleNotice.from_wire(wire["idle_release"], where=f"{where}.idle_release")
            if "idle_release" in wire
            else None,
            holder_lost=LostHolderNotice.from_wire(
                wire["holder_lost"], where=f"{where}.holder_lost"
            )
            if "holder_lost" in wire
            else None,
        )


def _stamp(wire: Mapping[str, object], name: str, where: str) -> datetime:
    try:
        return parse_timestamp(_member(wire, name, str, where))
    except ValueError as error:
        raise ValueError(f"{where}.{name}: {error}") from error


@dataclass(frozen=True)
class IdleNotice:
    """The idle policy will release a GPU at ``release_at`` unless it is used before."""

    reason: str
    """``idle`` (unused for the idle period) or ``lease`` (its maximum lease ended)."""
    release_at: datetime

    @classmethod
    def from_wire(cls, value: object, *, where: str) -> IdleNotice:
        return cls(*_reason_and_time(value, "release_at", where))


@dataclass(frozen=True)
class LostHolderNotice:
    """What reserved a GPU is gone (its holder pod preempted, evicted or deleted): the agent
    revokes the access at ``revoke_at``."""

    reason: str
    revoke_at: datetime

    @classmethod
    def from_wire(cls, value: object, *, where: str) -> LostHolderNotice:
        return cls(*_reason_and_time(value, "revoke_at", where))


def _reason_and_time(value: object, moment: str, where: str) -> tuple[str, datetime]:
    """A notice's ``reason`` and its announced moment (named ``moment``)."""
    wire = _object(value, where)
    return _member(wire, "reason", str, where), _stamp(wire, moment, where)


@dataclass(frozen=True)
class IdleRelease:
    """A GPU the idle policy took back (``GET /v1/idle-releases``)."""

    uuid: GpuUuid
    target: TargetRef
    reason: str
    released_at: datetime

    @classmethod
    def from_wire(cls, value: object, *, where: str) -> IdleRelease:
        wire = _object(value, where)
        return cls(
            uuid=GpuUuid(_member(wire, "uuid", str, where)),
            target=_target(_member(wire, "target", object, where), f"{where}.target"),
            reason=_member(wire, "reason", str, where),
            released_at=_stamp(wire, "released_at", where),
        )


@dataclass(frozen=True)
class QueuedRequest:
    """An attach waiting for GPUs in the node's queue; ``position`` 1 is served next."""

    request_id: str
    target: TargetRef
    count: int
    position: int
    length: int
    """How many requests wait on the node in all."""
    queued_at: datetime


def parse_idle_releases(value: object) -> tuple[IdleRelease, ...]:
    """The body of ``GET /v1/idle-releases``."""
    body = _object(value, "body")
    return tuple(
        IdleRelease.from_wire(item, where=f"releases[{i}]")
        for i, item in enumerate(_list(body, "releases", "body"))
    )


def parse_queue(value: object) -> tuple[QueuedRequest, ...]:
    """The body of ``GET /v1/queue``: the target's waiting requests."""
    body = _object(value, "body")
    length = _member(body, "length", int, "body")
    requests = []
    for i, item in enumerate(_list(body, "requests", "body")):
        where = f"requests[{i}]"
        wire = _object(item, where)
        requests.append(
            QueuedRequest(
                request_id=_member(wire, "request_id", str, where),
                target=_target(_member(wire, "target", object, where), f"{where}.target"),
                count=_member(wire, "count", int, where),
                position=_member(wire, "position", int, where),
                length=length,
                queued_at=_stamp(wire, "queued_at", where),
            )
        )
    return tuple(requests)


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


_SUSPENSION_STATES: Final[frozenset[str]] = frozenset({"suspending", "suspended"})


@dataclass(frozen=True)
class Suspension:
    """A target's CUDA state kept in host memory without its GPUs (a detach with ``keep``):
    its next attach resumes it on GPUs of ``model``, ``uuids`` first when free."""

    state: str
    """``suspended``; ``suspending`` only while the suspend runs."""
    model: str
    uuids: tuple[GpuUuid, ...]
    pids: tuple[int, ...]
    host_memory: int | None
    """Bytes of device memory kept in host memory, as the driver or else NVML says (``None``
    when neither does)."""

    @classmethod
    def from_wire(cls, value: object, *, where: str) -> Suspension:
        wire = _object(value, where)
        memory = _member(wire, "host_memory", object, where)
        if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool)):
            raise ValueError(
                f"{where}.host_memory must be int or null, not {type(memory).__name__}"
            )
        return cls(
            state=_one_of(wire, "state", _SUSPENSION_STATES, where),
            model=_member(wire, "model", str, where),
            uuids=tuple(GpuUuid(uuid) for uuid in _items(wire, "uuids", str, where)),
            pids=_items(wire, "pids", int, where),
            host_memory=memory,
        )


@dataclass(frozen=True)
class AttachmentState:
    """All ``GET /v1/attachments`` says of a target: its GPUs and, while its CUDA state is
    kept without them, that suspension (``None`` otherwise, and from an agent older than it)."""

    attachments: tuple[Attachment, ...]
    suspended: Suspension | None


def parse_attachment_state(value: object) -> AttachmentState:
    """The body of ``GET /v1/attachments``, ``suspended`` included."""
    body = _object(value, "body")
    suspended = body.get("suspended")
    return AttachmentState(
        attachments=parse_attachments(body),
        suspended=None
        if suspended is None
        else Suspension.from_wire(suspended, where="body.suspended"),
    )


def parse_health(value: object) -> Health:
    """The body of ``GET /healthz``."""
    return Health(status=_member(_object(value, "body"), "status", str, "body"))
