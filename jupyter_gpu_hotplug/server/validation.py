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
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NewType

from .._structs import (
    GPU_UUID_RE,
    MAX_WAIT_SECONDS,
    REQUEST_ID_MAX,
    REQUEST_ID_RE,
    GpuUuid,
    RequestId,
    WireFormatError,
    load_request_json,
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

_ATTACH_FIELDS: Final = ("count", "kernel_id", "request_id", "wait_seconds")
_DETACH_FIELDS: Final = ("force", "kernel_id", "uuid")
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


@dataclass(frozen=True)
class DetachRequest:
    """``POST detach``: release one GPU (``uuid``) or all of them (``uuid is None``)."""

    uuid: GpuUuid | None
    force: bool = False
    kernel_id: KernelId | None = None


@dataclass(frozen=True)
class CancelRequest:
    """``POST cancel``: take the kernel's (or, in Kubernetes, the pod's) waiting attach
    ``request_id`` out of the agent's queue."""

    request_id: RequestId
    kernel_id: KernelId | None = None


def _describe(value: object) -> str:
    """A short, safe rendering of a rejected value for messages."""
    if value is None:
        return "nothing"
    if not isinstance(value, str | int | float | bool):
        return type(value).__name__
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _json_object(body: bytes) -> dict[str, object]:
    # The agent reads its bodies with the same function: both APIs refuse the same bytes.
    try:
        value = load_request_json(body, max_body=MAX_BODY_BYTES)
    except WireFormatError as error:
        raise InvalidInput(error.message, field=error.field) from error
    if not isinstance(value, dict):
        raise InvalidInput(
            f"the body must be a JSON object, not {_describe(value)}",
            field="body",
        )
    return value


def _only(obj: Mapping[str, object], allowed: Sequence[str], *, where: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise InvalidInput(
            f"unknown {where} {', '.join(repr(name) for name in unknown)}; "
            f"accepted: {', '.join(allowed)}",
            field=unknown[0],
        )


def _kernel_id(value: object) -> KernelId:
    if not isinstance(value, str) or _KERNEL_ID_RE.fullmatch(value) is None:
        raise InvalidInput(
            f"kernel_id must be a kernel's id as /api/kernels lists it, got {_describe(value)}",
            field="kernel_id",
        )
    return KernelId(value)


def _optional_kernel_id(obj: Mapping[str, object]) -> KernelId | None:
    value = obj.get("kernel_id")
    return None if value is None else _kernel_id(value)


def parse_attach(body: bytes, *, max_count: int) -> AttachRequest:
    """``{"count": N, "kernel_id"?, "wait_seconds"?, "request_id"?}``."""
    obj = _json_object(body)
    _only(obj, _ATTACH_FIELDS, where="member")
    if "count" not in obj:
        raise InvalidInput("count is required: how many GPUs to attach", field="count")
    count = obj["count"]
    # bool is an int to isinstance, never to this API.
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= max_count:
        raise InvalidInput(
            f"count must be a whole number from 1 to {max_count}, got {_describe(count)}",
            field="count",
        )
    wait_seconds = obj.get("wait_seconds")
    if wait_seconds is not None and (
        not isinstance(wait_seconds, int | float)
        or isinstance(wait_seconds, bool)
        or not math.isfinite(wait_seconds)
        or not 0 < wait_seconds <= MAX_WAIT_SECONDS
    ):
        raise InvalidInput(
            f"wait_seconds must be a number of seconds greater than 0 and at most "
            f"{MAX_WAIT_SECONDS:g}, got {_describe(wait_seconds)}",
            field="wait_seconds",
        )
    request_id = obj.get("request_id")
    return AttachRequest(
        count=count,
        kernel_id=_optional_kernel_id(obj),
        wait_seconds=None if wait_seconds is None else float(wait_seconds),
        request_id=None if request_id is None else _request_id(request_id),
    )


def _request_id(value: object) -> RequestId:
    if not isinstance(value, str) or REQUEST_ID_RE.fullmatch(value) is None:
        raise InvalidInput(
            f"request_id must be 1 to {REQUEST_ID_MAX} letters, digits or . _ : -, "
            f"got {_describe(value)}",
            field="request_id",
        )
    return RequestId(value)


def parse_cancel(body: bytes) -> CancelRequest:
    """``{"request_id": R, "kernel_id"?}``: the waiting attach to cancel."""
    obj = _json_object(body)
    _only(obj, _CANCEL_FIELDS, where="member")
    if "request_id" not in obj:
        raise InvalidInput(
            "request_id is required: the waiting attach to cancel (as its progress names it)",
            field="request_id",
        )
    return CancelRequest(
        request_id=_request_id(obj["request_id"]), kernel_id=_optional_kernel_id(obj)
    )


def parse_detach(body: bytes) -> DetachRequest:
    """``{"uuid": "GPU-…" | "all", "force"?: bool, "kernel_id"?}``."""
    obj = _json_object(body)
    _only(obj, _DETACH_FIELDS, where="member")
    if "uuid" not in obj:
        raise InvalidInput(
            'uuid is required: the GPU to detach (as listed by GET gpus), or "all"',
            field="uuid",
        )
    uuid = obj["uuid"]
    if uuid != DETACH_ALL and (not isinstance(uuid, str) or GPU_UUID_RE.fullmatch(uuid) is None):
        raise InvalidInput(
            'uuid must be "all" or a GPU UUID like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx '
            f"(lowercase hex, as GET gpus lists it), got {_describe(uuid)}",
            field="uuid",
        )
    force = obj.get("force", False)
    if not isinstance(force, bool):
        raise InvalidInput(f"force must be true or false, got {_describe(force)}", field="force")
    return DetachRequest(
        uuid=None if uuid == DETACH_ALL else GpuUuid(str(uuid)),
        force=force,
        kernel_id=_optional_kernel_id(obj),
    )


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
