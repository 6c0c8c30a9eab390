"""Strict, pure parsing of the agent API's inputs: request bodies, query arguments, path ids.

Why a module of its own: every byte a caller sends passes through here before the service sees
it, so this is where "never trust the caller" is kept in one reviewable place. Each function
either returns a frozen value or raises ``InvalidRequest`` naming the offending field and saying
what would be accepted; nothing else escapes (the tests feed arbitrary bytes and JSON to prove
it). No I/O: whether a pid exists or a pod is the caller's own is the service's business.

The limits here and in ``openapi.json`` must agree; ``tests/agent/test_openapi.py`` checks that.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Final

from ..._httpkit import load_request_json
from ..._structs import (
    DEFAULT_WAIT_SECONDS,
    MAX_IDLE_RELEASE_SECONDS,
    MAX_WAIT_SECONDS,
    MIG_PROFILE_RE,
    PID_MAX_LIMIT,
    FieldChecks,
    GpuUuid,
    PidRef,
    PodTarget,
    RequestId,
    TargetRef,
    check_count,
    check_detach_flags,
    check_dns1123_label,
    check_dns1123_subdomain,
    check_gpu_uuid,
    check_named_gpus,
    check_names,
    check_request_id,
    check_required,
    check_seconds,
    check_selector,
    check_text,
    describe_value,
    json_integer,
)
from ..core.errors import InvalidRequest
from ..core.seams import AttachRequest

MAX_BODY_BYTES = 64 * 1024
_PID_TEXT_RE = re.compile(r"[1-9][0-9]{0,6}")
_BODY_FIELDS = (
    "count",
    "gpus",
    "idle_release_seconds",
    "mig",
    "min_memory",
    "model",
    "request_id",
    "target",
    "wait_seconds",
)
_POD_FIELDS = ("namespace", "name", "container")
_FORCE_VALUES = {"true": True, "1": True, "false": False, "0": False}


# --- helpers -------------------------------------------------------------------------------------

_checked: Final = FieldChecks(InvalidRequest)
"""Runs one of the field rules both APIs share (``_structs``) as this API's error."""


def _check_fields(
    obj: Mapping[str, object], *, allowed: Sequence[str], where: str, prefix: str
) -> None:
    _checked(check_names, obj, allowed=allowed, what=f"member(s) of {where}", prefix=prefix)


def _check_pid(value: object, *, field: str) -> PidRef:
    pid = json_integer(value)
    if pid == 1:
        raise InvalidRequest(
            f"{field} 1 is the init process of the agent's pid namespace and can never be a target",
            field=field,
            hint="give the pid of the process (e.g. the kernel) that should get the GPU",
        )
    if pid is None or not 2 <= pid < PID_MAX_LIMIT:
        raise InvalidRequest(
            f"{field} must be a process id, an integer from 2 to {PID_MAX_LIMIT - 1}, "
            f"got {describe_value(value)}",
            field=field,
        )
    return PidRef(pid)


def _parse_target(value: object) -> TargetRef:
    shape = 'target must be {"pod": {"namespace": ..., "name": ...}} or {"pid": N}'
    if not isinstance(value, dict):
        raise InvalidRequest(f"{shape}, got {describe_value(value)}", field="target")
    _check_fields(value, allowed=("pid", "pod"), where="target", prefix="target.")
    if len(value) != 1:
        raise InvalidRequest(
            f"{shape}: give exactly one of pod or pid, got "
            f"{'both' if value else 'an empty object'}",
            field="target",
        )
    if "pid" in value:
        return _check_pid(value["pid"], field="target.pid")
    pod = value["pod"]
    if not isinstance(pod, dict):
        raise InvalidRequest(
            f'target.pod must be {{"namespace": ..., "name": ..., "container": ...}}, '
            f"got {describe_value(pod)}",
            field="target.pod",
        )
    _check_fields(pod, allowed=_POD_FIELDS, where="target.pod", prefix="target.pod.")
    for required in ("namespace", "name"):
        if required not in pod:
            raise InvalidRequest(
                f"target.pod.{required} is required (the pod's {required})",
                field=f"target.pod.{required}",
            )
    ns_field, name_field, container_field = (f"target.pod.{member}" for member in _POD_FIELDS)
    return PodTarget(
        _checked(check_dns1123_label, pod["namespace"], subject=ns_field, field=ns_field),
        _checked(check_dns1123_subdomain, pod["name"], subject=name_field, field=name_field),
        _checked(
            check_dns1123_label, pod["container"], subject=container_field, field=container_field
        )
        if "container" in pod
        else None,
    )


# --- bodies --------------------------------------------------------------------------------------


def parse_attach_request(body: bytes, *, max_body: int = MAX_BODY_BYTES) -> AttachRequest:
    """Parse a ``POST /v1/attachments`` body.

    ``count`` is any positive integer, as the document says: more than the target may hold is
    the service's ``forbidden`` and more than the node has its ``insufficient_gpus``
    (``admission.decide``, the one place that weighs the limits and the node).
    """
    obj = _checked(load_request_json, body, max_body=max_body)
    if not isinstance(obj, dict):
        raise InvalidRequest(
            f'request body must be a JSON object such as {{"count": 1}}, got {describe_value(obj)}',
            field="body",
        )
    _check_fields(obj, allowed=_BODY_FIELDS, where="the request body", prefix="")

    count = _checked(
        check_count,
        _checked(check_required, obj, "count", why="the number of GPUs to attach"),
    )
    wait_seconds = _seconds(obj, "wait_seconds", MAX_WAIT_SECONDS)
    idle_release_seconds = _seconds(obj, "idle_release_seconds", MAX_IDLE_RELEASE_SECONDS)
    request_id = parse_request_id(obj["request_id"]) if "request_id" in obj else None
    mig = _mig_profile(obj["mig"]) if "mig" in obj else None
    gpus = _checked(check_named_gpus, obj["gpus"], count=count) if "gpus" in obj else ()

    target = _parse_target(obj["target"]) if "target" in obj else None
    return AttachRequest(
        count=count,
        target=target,
        wait_seconds=DEFAULT_WAIT_SECONDS if wait_seconds is None else wait_seconds,
        request_id=request_id,
        idle_release_seconds=idle_release_seconds,
        mig=mig,
        gpus=gpus,
        selector=_checked(check_selector, obj, named="gpus" in obj, mig=mig is not None),
        queued=wait_seconds is not None,
    )


def _mig_profile(value: object) -> str:
    """A MIG GPU instance profile as NVIDIA names them: ``<slices>g.<memory>gb``."""
    shape = "a MIG profile such as 1g.10gb (<slices>g.<memory>gb)"
    return _checked(check_text, value, MIG_PROFILE_RE, field="mig", shape=shape)


def _seconds(obj: dict[str, object], name: str, maximum: float) -> float | None:
    """The optional member ``name``: a number of seconds above 0 and at most ``maximum``."""
    return _checked(check_seconds, obj[name], field=name, maximum=maximum) if name in obj else None


def parse_request_id(value: object) -> RequestId:
    """A client's idempotency key: 1 to 128 of ``A-Z a-z 0-9 . _ : -``."""
    return _checked(check_request_id, value)


# --- path and query ------------------------------------------------------------------------------


def parse_gpu_uuid(text: str) -> GpuUuid:
    """A GPU or MIG UUID as NVML writes it: ``GPU-`` or ``MIG-`` and a lowercase-hex UUID.

    The pre-R470 MIG form ``MIG-GPU-<uuid>/<gi>/<ci>`` is not accepted: it contains ``/`` and
    cannot be a path segment, and drivers since R470 report the plain form.
    """
    return _checked(check_gpu_uuid, text)


def _single(query: Mapping[str, Sequence[bytes]], name: str) -> str | None:
    values = query.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequest(
            f"query parameter {name} is given {len(values)} times; give it once", field=name
        )
    try:
        return values[0].decode("ascii")
    except UnicodeDecodeError as e:
        raise InvalidRequest(
            f"query parameter {name} must be ASCII, got {describe_value(values[0])}", field=name
        ) from e


def check_query_names(query: Mapping[str, Sequence[bytes]], *, allowed: Collection[str]) -> None:
    """Refuse query parameters an endpoint does not know (a typo must not be ignored)."""
    _checked(check_names, query, allowed=sorted(allowed), what="query parameter(s)")


def parse_target_query(query: Mapping[str, Sequence[bytes]]) -> TargetRef | None:
    """``?pod=NS/NAME[&container=C]`` or ``?pid=N``; ``None`` when neither (the caller itself).

    ``query`` is shaped like tornado's ``request.query_arguments``. Other parameters are left
    alone (``check_query_names`` is the endpoint's job).
    """
    pod = _single(query, "pod")
    pid = _single(query, "pid")
    container = _single(query, "container")
    if pod is not None and pid is not None:
        raise InvalidRequest(
            "give the target either as pod=NAMESPACE/NAME or as pid=N, not both", field="pid"
        )
    if container is not None and pod is None:
        raise InvalidRequest(
            "query parameter container needs pod=NAMESPACE/NAME beside it", field="container"
        )
    if pid is not None:
        if _PID_TEXT_RE.fullmatch(pid) is None:
            raise InvalidRequest(
                f"query parameter pid must be a process id, an integer from 2 to "
                f"{PID_MAX_LIMIT - 1} in decimal digits, got {describe_value(pid)}",
                field="pid",
            )
        return _check_pid(int(pid), field="pid")
    if pod is None:
        return None
    namespace, slash, name = pod.partition("/")
    if not slash:
        raise InvalidRequest(
            f"query parameter pod must be NAMESPACE/NAME, got {describe_value(pod)}", field="pod"
        )
    return PodTarget(
        _checked(
            check_dns1123_label,
            namespace,
            subject="the namespace in query parameter pod",
            field="pod",
        ),
        _checked(
            check_dns1123_subdomain,
            name,
            subject="the pod name in query parameter pod",
            field="pod",
        ),
        None
        if container is None
        else _checked(
            check_dns1123_label, container, subject="query parameter container", field="container"
        ),
    )


def parse_force(query: Mapping[str, Sequence[bytes]]) -> bool:
    """``?force=true|false|1|0``; absent means ``False``."""
    return _flag(query, "force")


def parse_detach_all(query: Mapping[str, Sequence[bytes]]) -> tuple[bool, bool]:
    """``force`` and ``keep`` of ``DELETE /v1/attachments``: both default to ``False``, and
    never both (force ends the processes whose state keep would save)."""
    force, keep = _flag(query, "force"), _flag(query, "keep")
    _checked(check_detach_flags, force=force, keep=keep)
    return force, keep


def _flag(query: Mapping[str, Sequence[bytes]], name: str) -> bool:
    """``?<name>=true|false|1|0``; absent means ``False``."""
    value = _single(query, name)
    if value is None:
        return False
    if value not in _FORCE_VALUES:
        raise InvalidRequest(
            f"query parameter {name} must be true, false, 1 or 0, got {describe_value(value)}",
            field=name,
        )
    return _FORCE_VALUES[value]
