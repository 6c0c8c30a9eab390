"""Strict parsing of the REST API's inputs into frozen request values.

Boundary: bytes and query arguments in, ``AttachRequest`` / ``DetachRequest`` / a kernel id
out, or ``InvalidInput`` naming the field at fault. No I/O.

Why strict: the browser, the ``%gpu`` magic and scripts all send these bodies, and a typo
(``"cnt": 1``, ``"force": "yes"``) silently ignored would do something other than what was
asked — attach with defaults, or refuse to force a detach the user asked to force. So unknown
members, wrong types and out-of-range values are refused with a message that says what is
accepted, before the agent is asked anything.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NewType

from .. import _structs as wire
from .._httpkit import load_request_json
from .._structs import (
    MAX_WAIT_SECONDS,
    FieldChecks,
    GpuSelector,
    GpuUuid,
    RequestId,
    describe_value,
)
from .errors import InvalidInput

__all__ = [
    "DETACH_ALL",
    "MAX_BODY_BYTES",
    "MAX_WAIT_SECONDS",
    "AttachRequest",
    "CancelRequest",
    "DetachRequest",
    "KernelId",
    "parse_attach",
    "parse_cancel",
    "parse_detach",
    "parse_kernel_query",
]

KernelId = NewType("KernelId", str)
"""A Jupyter kernel id, as the kernels REST API names kernels."""

MAX_BODY_BYTES: Final = 16 * 1024
"""Far more than any valid body; a larger one is refused before it is parsed."""

# Kernel ids are UUIDs in jupyter_server; other kernel managers use similar safe tokens. The
# id is echoed in messages, so nothing outside this set is accepted.
_KERNEL_ID_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,128}")
DETACH_ALL: Final = "all"

_ATTACH_FIELDS: Final = (
    "count",
    "gpus",
    "kernel_id",
    "min_memory",
    "model",
    "request_id",
    "wait_seconds",
)
_DETACH_FIELDS: Final = ("force", "keep", "kernel_id", "uuid")
_CANCEL_FIELDS: Final = ("kernel_id", "request_id")
_QUERY_FIELDS: Final = ("kernel_id",)


@dataclass(frozen=True)
class AttachRequest:
    """``POST attach``: attach ``count`` GPUs to the kernel (or, in Kubernetes, the pod)."""

    count: int
    kernel_id: KernelId | None = None
    wait_seconds: float | None = None
    """How long the agent may wait for GPUs; ``None``: the agent's default."""
    request_id: RequestId | None = None
    """Chosen by the caller to follow this attach on the stream and to retry it safely;
    ``None``: the server picks one."""
    gpus: tuple[GpuUuid, ...] = ()
    """The GPUs to attach (a GPU card's Attach names its own), ``count`` of them; empty: any
    free ones. The agent refuses it where the cluster picks the device (``selectable``)."""
    selector: GpuSelector | None = None
    """What each GPU must be (``model``, ``min_memory``); never with ``gpus``. Passed on to
    the agent, which refuses it where the cluster picks the device."""


@dataclass(frozen=True)
class DetachRequest:
    """``POST detach``: release one GPU (``uuid``) or all of them (``uuid is None``);
    ``keep``: all of them, the kernel's CUDA state suspended into host memory first."""

    uuid: GpuUuid | None
    force: bool = False
    kernel_id: KernelId | None = None
    keep: bool = False


@dataclass(frozen=True)
class CancelRequest:
    """``POST cancel``: take the kernel's (or, in Kubernetes, the pod's) waiting attach
    ``request_id`` out of the agent's queue."""

    request_id: RequestId
    kernel_id: KernelId | None = None


_checked: Final = FieldChecks(InvalidInput)
"""Runs one of the field rules both APIs share (``wire.check_*``, the wire contract's) as this
API's error; the agent reads its bodies with the same functions, so both refuse the same
values."""


def _json_object(body: bytes) -> dict[str, object]:
    value = _checked(load_request_json, body, max_body=MAX_BODY_BYTES)
    if not isinstance(value, dict):
        raise InvalidInput(
            f"the body must be a JSON object, not {describe_value(value)}",
            field="body",
        )
    return value


def _only(obj: Mapping[str, object], allowed: Sequence[str], *, where: str) -> None:
    _checked(wire.check_names, obj, allowed=allowed, what=f"{where}(s)")


def _kernel_id(value: object) -> KernelId:
    if not isinstance(value, str) or _KERNEL_ID_RE.fullmatch(value) is None:
        raise InvalidInput(
            "kernel_id must be a kernel's id as /api/kernels lists it, "
            f"got {describe_value(value)}",
            field="kernel_id",
        )
    return KernelId(value)


def _optional_kernel_id(obj: Mapping[str, object]) -> KernelId | None:
    value = obj.get("kernel_id")
    return None if value is None else _kernel_id(value)


def parse_attach(body: bytes, *, max_count: int) -> AttachRequest:
    """``{"count": N, "gpus"?: [UUID, ...], "model"?, "min_memory"?, "kernel_id"?,
    "wait_seconds"?, "request_id"?}``."""
    obj = _json_object(body)
    _only(obj, _ATTACH_FIELDS, where="member")
    count = _checked(
        wire.check_count,
        _checked(wire.check_required, obj, "count", why="how many GPUs to attach"),
        maximum=max_count,
    )
    raw_wait = obj.get("wait_seconds")
    wait_seconds = (
        None
        if raw_wait is None
        else _checked(wire.check_seconds, raw_wait, field="wait_seconds", maximum=MAX_WAIT_SECONDS)
    )
    request_id = obj.get("request_id")
    gpus = obj.get("gpus")
    return AttachRequest(
        count=count,
        kernel_id=_optional_kernel_id(obj),
        wait_seconds=wait_seconds,
        request_id=None if request_id is None else _checked(wire.check_request_id, request_id),
        gpus=() if gpus is None else _checked(wire.check_named_gpus, gpus, count=count),
        selector=_checked(wire.check_selector, obj, named=gpus is not None),
    )


def parse_cancel(body: bytes) -> CancelRequest:
    """``{"request_id": R, "kernel_id"?}``: the waiting attach to cancel."""
    obj = _json_object(body)
    _only(obj, _CANCEL_FIELDS, where="member")
    request_id = _checked(
        wire.check_required,
        obj,
        "request_id",
        why="the waiting attach to cancel (as its progress names it)",
    )
    return CancelRequest(
        request_id=_checked(wire.check_request_id, request_id), kernel_id=_optional_kernel_id(obj)
    )


def parse_detach(body: bytes) -> DetachRequest:
    """``{"uuid": "GPU-…" | "all", "force"?: bool, "keep"?: bool, "kernel_id"?}``; ``keep``
    only with ``"all"`` (the agent keeps a kernel's CUDA state whole, never one GPU's) and
    never with ``force`` (the agent's own rule, ``check_detach_flags``)."""
    obj = _json_object(body)
    _only(obj, _DETACH_FIELDS, where="member")
    uuid = _checked(
        wire.check_required, obj, "uuid", why='the GPU to detach (as listed by GET gpus), or "all"'
    )
    if uuid != DETACH_ALL:
        uuid = _checked(wire.check_gpu_uuid, uuid, alternatives=f"{json.dumps(DETACH_ALL)} or ")
    force, keep = _flag(obj, "force"), _flag(obj, "keep")
    _checked(wire.check_detach_flags, force=force, keep=keep)
    if keep and uuid != DETACH_ALL:
        raise InvalidInput(
            'keep suspends the whole kernel and gives back all of its GPUs: give "uuid": "all"',
            field="keep",
        )
    return DetachRequest(
        uuid=None if uuid == DETACH_ALL else GpuUuid(str(uuid)),
        force=force,
        kernel_id=_optional_kernel_id(obj),
        keep=keep,
    )


def _flag(obj: Mapping[str, object], name: str) -> bool:
    """An optional boolean member (absent: ``False``)."""
    value = obj.get(name, False)
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be true or false, got {describe_value(value)}", field=name)
    return value


def parse_kernel_query(arguments: Mapping[str, Sequence[bytes]]) -> KernelId | None:
    """The query of ``GET gpus`` and ``GET stream``: at most one ``kernel_id``."""
    _only(arguments, _QUERY_FIELDS, where="query parameter")
    values = arguments.get("kernel_id", [])
    if not values:
        return None
    if len(values) > 1:
        raise InvalidInput("give kernel_id at most once", field="kernel_id")
    try:
        text = bytes(values[0]).decode()
    except UnicodeDecodeError as error:
        raise InvalidInput("kernel_id must be text", field="kernel_id") from error
    return _kernel_id(text)
