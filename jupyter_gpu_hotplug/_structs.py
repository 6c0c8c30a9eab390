"""The agent API's data shapes (DESIGN §3), shared by the node agent and the notebook-side client.

Why this module exists: the agent and the notebook side must never import each other, yet both
speak the same JSON. The shapes live here, below both, as ``TypedDict`` payloads (exactly what goes
over the wire), ``NewType`` identifiers, and a few frozen dataclasses for the one value both sides
reason about: the *target* of an attach (a container of a pod, or a local process).

It is the ground floor: nothing here does I/O or imports anything of the project, nor any web
framework (import-linter holds it to that). Checks that need the host (does the pid exist, what is
its start time) belong to the callers; how a body is read off HTTP (bounded, strict JSON, the
lingering close of a refusal, ``Allow``) is the HTTP kit's, ``_httpkit``, one floor up.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import (
    Final,
    Literal,
    NewType,
    ParamSpec,
    Protocol,
    TypeAlias,
    TypedDict,
    TypeVar,
    final,
)

# --- identifiers ---------------------------------------------------------------------------------

GpuUuid = NewType("GpuUuid", str)
"""An NVML UUID: ``GPU-<uuid>`` for a whole GPU, ``MIG-<uuid>`` for a MIG slice."""

PodUid = NewType("PodUid", str)
"""A Kubernetes pod's ``metadata.uid``: tells a re-created pod apart from its namesake."""

RequestId = NewType("RequestId", str)
"""A client-chosen id that makes a retried attach idempotent (per target)."""

TargetKey = NewType("TargetKey", str)
"""A target's stable identity as one string, for per-target locks and the ledger."""

# --- facts of the contract, defined once for the agent, the client, the server and the magic ---

NVIDIA_MAJOR: Final = 195
"""The character-device major of NVIDIA's GPU and control nodes (``/dev/nvidia*``)."""

MAX_WAIT_SECONDS: Final = 600.0
"""The largest ``wait_seconds`` of an attach (``AttachRequest`` in ``openapi.json``)."""
DEFAULT_WAIT_SECONDS: Final = 60.0
"""The ``wait_seconds`` of an attach that does not say."""
MAX_IDLE_RELEASE_SECONDS: Final = 7 * 24 * 3600.0
"""The largest ``idle_release_seconds`` an attach may ask for (a week; the agent's own setting
may be any)."""
DEFAULT_MAX_GPUS_PER_TARGET: Final = 8
"""The most GPUs one target may hold, and one request ask for, unless configured otherwise."""

MAX_WAITERS_PER_CONTAINER: Final = 4
"""Attach requests one container may have waiting in the node's queue at once: more are refused
(409 ``busy``, retryable), so one container cannot fill the queue (issue 25)."""
QUEUE_OVERTAKES: Final = 4
"""How many requests that fit may be served before the first waiter that cannot be served yet;
after that, GPUs that are freed are held for it (so it is never starved)."""

MIG_PROFILE_RE: Final = re.compile(r"[1-8]g\.[1-9][0-9]{0,3}gb(?:\+me)?")
"""A MIG GPU instance profile as NVIDIA names them (``1g.10gb``); use with ``fullmatch``."""

REQUEST_ID_MAX: Final = 128
REQUEST_ID_RE: Final = re.compile(rf"[A-Za-z0-9._:-]{{1,{REQUEST_ID_MAX}}}")
"""A client-chosen ``request_id``; use with ``fullmatch``."""
GPU_UUID_RE: Final = re.compile(
    r"(?:GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
)
"""An NVML UUID as the API accepts it (a GPU or a MIG slice); use with ``fullmatch``."""

AGENT_URL_ENV: Final = "GPU_HOTPLUG_AGENT_URL"
"""Set by the spawner to the node agent's URL."""
TOKEN_PATH_ENV: Final = "GPU_HOTPLUG_TOKEN_PATH"
"""Set by the spawner to the projected service-account token's path."""
DEFAULT_SOCKET: Final = PurePosixPath("/run/gpu-hotplug/agent.sock")
"""Where the local-mode agent listens by default."""
DEFAULT_AGENT_URL: Final = f"unix:{DEFAULT_SOCKET}"
"""The agent URL a client uses when ``AGENT_URL_ENV`` is unset or empty."""
SANDBOX_PID_ENV: Final = "GPU_HOTPLUG_SANDBOX_PID"
"""Set in a local-mode sandbox: the pid, as the host (and the agent) number it, that stands
for the sandbox — the target the agent names in its answers. A sandboxed process's own
``os.getpid()`` is its pid namespace's."""

# --- limits shared by validation, the OpenAPI document and the dataclasses below ---------------

PID_MAX_LIMIT = 2**22
"""The kernel's ``PID_MAX_LIMIT`` on 64-bit: every pid is below it (``/proc/sys/kernel/pid_max``
can be raised at most to this value)."""

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253

_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL_RE = re.compile(_LABEL)
"""Kubernetes' DNS-1123 label (namespace and container names); use with ``fullmatch``."""
DNS1123_SUBDOMAIN_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
"""Kubernetes' DNS-1123 subdomain (pod names); use with ``fullmatch``."""


def is_dns1123_label(text: str) -> bool:
    """Whether ``text`` is a valid namespace or container name."""
    return len(text) <= DNS1123_LABEL_MAX and DNS1123_LABEL_RE.fullmatch(text) is not None


def is_dns1123_subdomain(text: str) -> bool:
    """Whether ``text`` is a valid pod name."""
    return len(text) <= DNS1123_SUBDOMAIN_MAX and DNS1123_SUBDOMAIN_RE.fullmatch(text) is not None


# --- wire payloads (exact JSON shapes of DESIGN §3) ---------------------------------------------


# Optional members are declared through a ``total=False`` subclass rather than ``NotRequired``:
# under ``from __future__ import annotations`` Python 3.11 cannot see ``NotRequired`` at
# runtime, and the OpenAPI test compares ``__required_keys__`` with the document.


class _PodRefRequired(TypedDict):
    namespace: str
    name: str


class PodRefWire(_PodRefRequired, total=False):
    """The ``pod`` member of a target; ``container`` may be left out in requests only."""

    container: str


@final  # final: lets type checkers narrow ``TargetWire`` with ``"pod" in wire``
class PodTargetWire(TypedDict):
    """``{"pod": {"namespace", "name", "container"}}``."""

    pod: PodRefWire


@final
class PidTargetWire(TypedDict):
    """``{"pid": 1234}`` (local mode)."""

    pid: int


TargetWire: TypeAlias = PodTargetWire | PidTargetWire

GpuState = Literal["free", "attached", "allocated"]
"""``allocated``: held by a pod through the device plugin; ``attached``: hot-attached by us."""

GpuKind = Literal["gpu", "mig_parent", "mig_slice"]
"""What a listed GPU is, so that no client guesses it from its UUID: ``gpu``, a whole GPU;
``mig_parent``, a GPU in MIG mode, never handed out whole (its slices are listed too);
``mig_slice``, one MIG slice (``MIG-`` UUID)."""


class GpuInfo(TypedDict):
    """One entry of ``GET /v1/gpus``."""

    uuid: GpuUuid
    index: int
    minor: int
    name: str
    memory_total: int
    state: GpuState
    target: TargetWire | None
    simulated: bool
    selectable: bool
    """An attach may name this GPU (``AttachRequestBody.gpus``): false where the cluster picks
    the device (Kubernetes: the kubelet's device plugin) and for a GPU in MIG mode (handed out
    only as its slices)."""
    kind: GpuKind
    plain_attach: bool
    """An attach of ``count`` alone (no ``gpus``; no ``mig``, or the agent's own profile) may
    get this GPU when it is free: a whole GPU, or, where the agent hands out slices of one
    profile only (Kubernetes with ``--resource-name nvidia.com/mig-…``), a slice of it. What
    every "N free" and "Attach N" counts: a GPU in MIG mode never, a slice of another
    profile only when asked for by its profile."""


class GpuList(TypedDict):
    """The body of ``GET /v1/gpus``."""

    gpus: list[GpuInfo]


IdleReason = Literal["idle", "lease"]
"""Why the idle policy releases a GPU: unused for the idle period, or its maximum lease ended."""


class IdleReleaseWire(TypedDict):
    """A warning on an attachment: it will be released at ``release_at`` unless it is used."""

    reason: IdleReason
    release_at: str


class LostHolderWire(TypedDict):
    """A warning on an attachment: what reserved it is gone (a holder pod preempted, evicted
    or deleted), and the agent takes the access away at ``revoke_at``."""

    reason: str
    revoke_at: str


class _AttachmentRequired(TypedDict):
    uuid: GpuUuid
    index: int
    minor: int
    name: str
    device: str
    target: TargetWire
    holder: str | None
    attached_at: str


class Attachment(_AttachmentRequired, total=False):
    """One hot-attached GPU; ``holder`` is the ``ns/name`` of its holder pod (``None`` locally).
    ``idle_release`` is there only while the idle policy has announced its release;
    ``holder_lost`` only while the revoke of a GPU whose reservation was lost is announced."""

    idle_release: IdleReleaseWire
    holder_lost: LostHolderWire


class IdleReleaseRecord(TypedDict):
    """A GPU the idle policy took back from a target (``GET /v1/idle-releases``)."""

    uuid: GpuUuid
    target: TargetWire
    reason: IdleReason
    released_at: str


class QueuedRequest(TypedDict):
    """An attach request waiting for GPUs; ``position`` 1 is served next."""

    request_id: str
    target: TargetWire
    count: int
    position: int
    queued_at: str


class QueueView(TypedDict):
    """The body of ``GET /v1/queue``: the target's waiting requests among ``length`` in all."""

    length: int
    requests: list[QueuedRequest]


class IdleReleaseList(TypedDict):
    """The body of ``GET /v1/idle-releases``: the target's recent idle releases, oldest first."""

    releases: list[IdleReleaseRecord]


class _SuspendedRequired(TypedDict):
    state: Literal["suspending", "suspended"]
    model: str
    uuids: list[GpuUuid]
    pids: list[int]
    host_memory: int | None


class SuspendedWire(_SuspendedRequired):
    """A target whose CUDA state the agent keeps in host memory without its GPUs (a detach
    with ``keep``): its processes are checkpointed, and its next attach resumes them on GPUs
    of ``model`` (``uuids`` first, when free). ``host_memory``: bytes kept, when the driver
    says; ``state`` ``suspending`` only while the suspend runs."""


class _AttachmentListRequired(TypedDict):
    attachments: list[Attachment]


class AttachmentList(_AttachmentListRequired, total=False):
    """The body of ``GET /v1/attachments`` and of a ``201`` from ``POST /v1/attachments``;
    ``suspended`` is there only while the target's CUDA state is kept without its GPUs."""

    suspended: SuspendedWire


class _AttachRequestRequired(TypedDict):
    count: int


class SelectorWire(TypedDict, total=False):
    """The members of an attach that ask for GPUs by attribute (``GpuSelector``)."""

    model: str
    """A case-insensitive part of the GPU's product name as NVML reports it (``H100``)."""
    min_memory: int
    """The least memory, in bytes, each GPU must have."""


class AttachRequestBody(_AttachRequestRequired, SelectorWire, total=False):
    """The body of ``POST /v1/attachments``; only ``count`` is required."""

    target: TargetWire
    wait_seconds: float
    request_id: str
    idle_release_seconds: float
    mig: str
    gpus: list[GpuUuid]
    """Attach exactly these GPUs (or MIG slices), ``count`` of them."""


ErrorCode = Literal[
    "invalid_request",
    "unauthenticated",
    "forbidden",
    "not_found",
    "busy",
    "insufficient_gpus",
    "target_not_ready",
    "timeout",
    "internal_error",
]


STATUS_BY_CODE: Final[Mapping[ErrorCode, int]] = {
    "invalid_request": 400,
    "unauthenticated": 401,
    "forbidden": 403,
    "not_found": 404,
    "busy": 409,
    "insufficient_gpus": 409,
    "target_not_ready": 422,
    "timeout": 504,
    "internal_error": 500,
}
"""The HTTP status of each error code (DESIGN §3); ``busy`` is the general 409."""

EXTRA_FIELDS_BY_CODE: Final[Mapping[ErrorCode, frozenset[str]]] = {
    "invalid_request": frozenset({"field"}),
    "unauthenticated": frozenset(),
    "forbidden": frozenset({"limit", "attached", "requested"}),
    "not_found": frozenset({"resource", "name"}),
    "busy": frozenset({"processes", "uuid", "retry_after"}),
    "insufficient_gpus": frozenset({"free", "requested"}),
    "target_not_ready": frozenset(),
    "timeout": frozenset({"wait_seconds"}),
    "internal_error": frozenset({"request_id"}),
}
"""The ``ErrorExtra`` members each error code may carry beside the envelope."""

ERROR_ENVELOPE: Final = frozenset({"error", "message", "retryable"})
"""The members every error body has."""


class ProcessInfo(TypedDict):
    """A process that keeps a GPU busy: listed in a ``busy`` error."""

    pid: int
    command: str


class ErrorExtra(TypedDict, total=False):
    """The members particular error codes add to an ``ErrorBody`` (see ``agent/errors.py``)."""

    field: str
    resource: str
    name: str
    uuid: GpuUuid
    processes: list[ProcessInfo]
    free: int
    requested: int
    limit: int
    attached: int
    wait_seconds: float
    request_id: str
    retry_after: int
    """Seconds after which to try again (also the ``Retry-After`` header): a 503."""


class ErrorBody(ErrorExtra):
    """Every error response. ``retryable``: sending the same request again later may succeed."""

    error: ErrorCode
    message: str
    retryable: bool


# --- request bodies: the rules both HTTP APIs apply (the agent's and the server extension's) ----


class WireFormatError(ValueError):
    """A request body, or one of its fields, that breaks the rules below (or is not one strict
    JSON document: ``_httpkit.load_request_json``); ``field`` names where it fails.

    Each API turns it into its own ``invalid_request`` error (400) with this message.
    """

    def __init__(self, message: str, *, field: str = "body") -> None:
        super().__init__(message)
        self.message = message
        self.field = field


# --- timestamps ----------------------------------------------------------------------------------


def format_timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC with a ``Z``, to the second, as Kubernetes writes timestamps."""
    if moment.tzinfo is None:
        raise ValueError("a wire timestamp needs a timezone-aware datetime")
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(text: str) -> datetime:
    """Read an RFC 3339 timestamp (any offset, optional fraction) as an aware UTC datetime."""
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"timestamp {text!r} has no timezone; RFC 3339 requires one")
    return moment.astimezone(UTC)


# --- the target as a value -----------------------------------------------------------------------


@dataclass(frozen=True)
class PodTarget:
    """A container of a pod; ``container=None`` means "the resolver picks", in requests only.

    The names are checked here too (not only by request validation), because the ``key`` must be
    parseable back: DNS-1123 names never contain ``/``.
    """

    namespace: str
    name: str
    container: str | None = None

    def __post_init__(self) -> None:
        if not is_dns1123_label(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} is not a DNS-1123 label")
        if not is_dns1123_subdomain(self.name):
            raise ValueError(f"pod name {self.name!r} is not a DNS-1123 subdomain")
        if self.container is not None and not is_dns1123_label(self.container):
            raise ValueError(f"container {self.container!r} is not a DNS-1123 label")

    @property
    def key(self) -> TargetKey:
        """``pod:NS/NAME/CONTAINER`` (or ``pod:NS/NAME`` while the container is unresolved)."""
        tail = "" if self.container is None else f"/{self.container}"
        return TargetKey(f"pod:{self.namespace}/{self.name}{tail}")

    def with_container(self, container: str) -> PodTarget:
        """The same pod with its container resolved."""
        return PodTarget(self.namespace, self.name, container)

    def to_wire(self) -> PodTargetWire:
        ref = PodRefWire(namespace=self.namespace, name=self.name)
        if self.container is not None:
            ref["container"] = self.container
        return PodTargetWire(pod=ref)

    @classmethod
    def from_wire(cls, wire: PodTargetWire) -> PodTarget:
        ref = wire["pod"]
        return cls(ref["namespace"], ref["name"], ref.get("container"))

    def __str__(self) -> str:
        tail = "" if self.container is None else f" container {self.container}"
        return f"pod {self.namespace}/{self.name}{tail}"


def _check_pid(pid: int) -> None:
    # pid 1 is init of the agent's pid namespace (the host's, for a DaemonSet with hostPID):
    # never a target. Request validation says so with a precise message before we get here.
    if not 2 <= pid < PID_MAX_LIMIT:
        raise ValueError(f"pid {pid} is outside 2..{PID_MAX_LIMIT - 1}")


@dataclass(frozen=True)
class PidRef:
    """A process as a request names it: a pid, not yet tied to one process lifetime.

    A pid alone is ambiguous over time (the kernel reuses pids), so it has no ``key``;
    ``resolve`` it with the start time read from ``/proc/<pid>/stat`` first.
    """

    pid: int

    def __post_init__(self) -> None:
        _check_pid(self.pid)

    def resolve(self, *, start_time: int) -> PidTarget:
        """Bind the pid to the process that has it now (``start_time``: stat field 22)."""
        return PidTarget(self.pid, start_time)

    def to_wire(self) -> PidTargetWire:
        return PidTargetWire(pid=self.pid)

    @classmethod
    def from_wire(cls, wire: PidTargetWire) -> PidRef:
        return cls(wire["pid"])

    def __str__(self) -> str:
        return f"process {self.pid}"


@dataclass(frozen=True)
class PidTarget:
    """One process lifetime: a pid plus its start time.

    ``start_time`` is field 22 of ``/proc/<pid>/stat`` (clock ticks after boot); the same pid
    with another start time is another process, so ledger rows of a dead process never apply
    to a newcomer that inherited its pid.
    """

    pid: int
    start_time: int

    def __post_init__(self) -> None:
        _check_pid(self.pid)
        if self.start_time < 0:
            raise ValueError(f"process start time {self.start_time} is negative")

    @property
    def key(self) -> TargetKey:
        """``pid:PID@START_TIME``."""
        return TargetKey(f"pid:{self.pid}@{self.start_time}")

    def to_wire(self) -> PidTargetWire:
        """The wire names only the pid: the start time is the agent's own bookkeeping."""
        return PidTargetWire(pid=self.pid)

    @classmethod
    def from_wire(cls, wire: PidTargetWire, *, start_time: int) -> PidTarget:
        return cls(wire["pid"], start_time)

    def __str__(self) -> str:
        return f"process {self.pid}"


Target: TypeAlias = PodTarget | PidTarget
"""A target bound to one identity: what locks and the ledger are keyed by."""

TargetRef: TypeAlias = PodTarget | PidRef
"""A target as a request names it (``PidRef`` still needs resolving to a ``PidTarget``)."""


def target_from_wire(wire: TargetWire) -> TargetRef:
    """The value of an already validated wire target (``ValueError`` if it is not well formed)."""
    if "pod" in wire:
        return PodTarget.from_wire(wire)
    if "pid" in wire:
        return PidRef.from_wire(wire)
    raise ValueError("a target has either a 'pod' or a 'pid' member")


_POD_KEY_RE = re.compile(r"pod:([^/]+)/([^/]+)(?:/([^/]+))?")
_PID_KEY_RE = re.compile(r"pid:([0-9]+)@([0-9]+)")


def target_from_key(key: str) -> Target:
    """Inverse of ``Target.key``: keys are lossless, so durable state needs to store only them."""
    if match := _POD_KEY_RE.fullmatch(key):
        namespace, name, container = match.groups()
        return PodTarget(namespace, name, container)
    if match := _PID_KEY_RE.fullmatch(key):
        return PidTarget(int(match[1]), int(match[2]))
    raise ValueError(f"{key!r} is not a target key")


# --- request fields: the rules both APIs apply (agent/api/validation.py, server/validation.py) ---
#
# Each check returns the value or raises ``WireFormatError`` naming the field; each API turns
# that into its own error (``InvalidRequest``, ``InvalidInput``) through its ``FieldChecks``, so
# the two refuse the same values with the same words.

_P = ParamSpec("_P")
_T = TypeVar("_T")


class FieldError(Protocol):
    """An API's own "invalid request" error (400), made from a refused field's message."""

    def __call__(self, message: str, /, *, field: str) -> Exception: ...


@dataclass(frozen=True)
class FieldChecks:
    """Runs the checks below (or ``_httpkit.load_request_json``) so that a refusal is
    ``error``, the calling API's own; each API's validation holds one, the only place it
    converts."""

    error: FieldError

    def __call__(self, check: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return check(*args, **kwargs)
        except WireFormatError as e:
            raise self.error(e.message, field=e.field) from e


def describe_value(value: object) -> str:
    """A short JSON-ish rendering of a refused value for messages (never a whole body)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def clip_name(name: str) -> str:
    """A caller-chosen name, short enough to echo in an error's ``field``."""
    return name if len(name) <= 64 else f"{name[:61]}..."


def json_integer(value: object) -> int | None:
    """``value`` as JSON Schema's ``integer`` reads it (``1`` and ``1.0``, never ``true``:
    ``bool`` is an ``int`` to Python only), else None; the documents say ``integer``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def check_names(
    names: Collection[str], *, allowed: Sequence[str], what: str, prefix: str = ""
) -> None:
    """Refuse names (members, query parameters) a request may not have: a typo is never
    ignored. ``what`` says what they are (``member(s) of target``, ``query parameter(s)``)."""
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        shown = ", ".join(describe_value(name) for name in unknown[:5])
        raise WireFormatError(
            f"unknown {what} {shown}; accepted: {', '.join(sorted(allowed)) or 'none'}",
            field=f"{prefix}{clip_name(unknown[0])}",
        )


def check_required(obj: Mapping[str, object], name: str, *, why: str) -> object:
    """The member ``name`` of a request body, which the request must have; ``why`` says what
    it is for, so the message tells the caller what to send."""
    if name not in obj:
        raise WireFormatError(f"{name} is required: {why}", field=name)
    return obj[name]


@dataclass(frozen=True)
class _DnsName:
    """One of Kubernetes' DNS-1123 name rules, as a request field checks it."""

    limit: int
    valid: Callable[[str], bool]
    shape: str
    """What a valid name looks like, in the refusal."""

    def check(self, value: object, *, subject: str, field: str) -> str:
        if isinstance(value, str) and len(value) > self.limit:
            raise WireFormatError(
                f"{subject} is {len(value)} characters long; the limit is {self.limit}",
                field=field,
            )
        if not isinstance(value, str) or not self.valid(value):
            raise WireFormatError(
                f"{subject} must be {self.shape}, got {describe_value(value)}", field=field
            )
        return value


_LABEL_NAME: Final = _DnsName(
    DNS1123_LABEL_MAX,
    is_dns1123_label,
    "a DNS-1123 label (lowercase letters, digits and '-', starting and ending with a letter or "
    "digit)",
)
_SUBDOMAIN_NAME: Final = _DnsName(
    DNS1123_SUBDOMAIN_MAX,
    is_dns1123_subdomain,
    "a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', each dot-separated part "
    "starting and ending with a letter or digit)",
)


def check_dns1123_label(value: object, *, subject: str, field: str) -> str:
    """A namespace or container name; ``subject`` names it in the message."""
    return _LABEL_NAME.check(value, subject=subject, field=field)


def check_dns1123_subdomain(value: object, *, subject: str, field: str) -> str:
    """A pod name; ``subject`` names it in the message."""
    return _SUBDOMAIN_NAME.check(value, subject=subject, field=field)


def check_count(value: object, *, maximum: int | None = None) -> int:
    """How many GPUs: a whole number from 1 (to ``maximum`` where the API has one)."""
    count = json_integer(value)
    if count is None or count < 1 or (maximum is not None and count > maximum):
        bound = "of at least 1" if maximum is None else f"from 1 to {maximum}"
        raise WireFormatError(
            f"count must be a whole number {bound} (the number of GPUs to attach), "
            f"got {describe_value(value)}",
            field="count",
        )
    return count


def check_seconds(value: object, *, field: str, maximum: float) -> float:
    """A duration: a number of seconds above 0 and at most ``maximum``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= maximum
    ):
        raise WireFormatError(
            f"{field} must be a number of seconds greater than 0 and at most {maximum:g}, "
            f"got {describe_value(value)}",
            field=field,
        )
    return float(value)


def check_text(value: object, pattern: re.Pattern[str], *, field: str, shape: str) -> str:
    """A string member that ``pattern`` must match whole; ``shape`` says what it looks like."""
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise WireFormatError(f"{field} must be {shape}, got {describe_value(value)}", field=field)
    return value


def check_request_id(value: object) -> RequestId:
    """A client's idempotency key (``REQUEST_ID_RE``)."""
    shape = f"1 to {REQUEST_ID_MAX} letters, digits or . _ : -"
    return RequestId(check_text(value, REQUEST_ID_RE, field="request_id", shape=shape))


def check_detach_flags(*, force: bool, keep: bool) -> None:
    """A detach's ``force`` and ``keep`` exclude each other: ``force`` ends the processes that
    hold the GPU, ``keep`` suspends them to save their CUDA state. Every API and the client
    refuse the pair with these words, before anything is asked of the GPUs."""
    if force and keep:
        raise WireFormatError(
            "force and keep exclude each other: force ends the processes that hold the GPU, "
            "keep suspends them to save their CUDA state; give one of the two",
            field="keep",
        )


def check_gpu_uuid(value: object, *, alternatives: str = "", field: str = "uuid") -> GpuUuid:
    """A GPU or MIG UUID as NVML writes it (``GPU_UUID_RE``); ``alternatives`` names what else
    the field accepts, for the message (``'"all" or '``)."""
    if not isinstance(value, str) or GPU_UUID_RE.fullmatch(value) is None:
        raise WireFormatError(
            f"{field} must be {alternatives}a GPU UUID like "
            f"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx or MIG-... with lowercase hex digits "
            f"(as nvidia-smi -L prints it), got {describe_value(value)}",
            field=field,
        )
    return GpuUuid(value)


def check_named_gpus(value: object, *, count: int) -> tuple[GpuUuid, ...]:
    """The GPUs an attach names (``gpus``): ``count`` different GPU or MIG UUIDs, so that the
    request says the same thing twice rather than two things that may disagree."""
    if not isinstance(value, list) or not value:
        raise WireFormatError(
            f"gpus must be a non-empty array of GPU UUIDs (as the GPU list names them), "
            f"got {describe_value(value)}",
            field="gpus",
        )
    if len(value) != count:
        raise WireFormatError(
            f"gpus names {len(value)} GPU(s) but count is {count}; give as many as count",
            field="gpus",
        )
    uuids = tuple(
        check_gpu_uuid(item, field=f"gpus[{position}]") for position, item in enumerate(value)
    )
    if len(set(uuids)) != len(uuids):
        raise WireFormatError("gpus names a GPU more than once", field="gpus")
    return uuids


MODEL_MAX: Final = 64
"""The longest ``model`` an attach may give (NVML's product names are shorter)."""
MODEL_RE: Final = re.compile(rf"[ -~]{{1,{MODEL_MAX}}}")
"""A ``model``: printable ASCII, as NVML's product names are (and a JSON Schema pattern can
say exactly, unlike Python's ``isprintable``)."""

_MEMORY_POWERS: Final = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_MEMORY_TEXT_RE: Final = re.compile(r"([1-9][0-9]*)\s*(?:([kmgt])(i?)b?|b?)", re.IGNORECASE)


def format_memory(size: int) -> str:
    """Bytes as a person reads a GPU's memory (binary units, as NVML and nvidia-smi count)."""
    return f"{size / 2**30:.4g} GiB" if size >= 2**30 else f"{size / 2**20:.4g} MiB"


@dataclass(frozen=True)
class GpuSelector:
    """What an attach asks of each GPU it gets beside the count: a model (part of the product
    name) and a least memory. One value for both APIs and the agent's candidates, so that
    what is validated is what is matched."""

    model: str | None = None
    min_memory: int | None = None

    def matches(self, name: str, memory_total: int) -> bool:
        """Whether a GPU of product name ``name`` and ``memory_total`` bytes may serve it."""
        return (self.model is None or self.model.casefold() in name.casefold()) and (
            self.min_memory is None or memory_total >= self.min_memory
        )

    @property
    def key(self) -> str:
        """What the queue orders waiters by (``Waiter.kind``): equal for equal selectors
        (the model's case aside), never a profile or a GPU UUID."""
        model = "" if self.model is None else self.model.casefold()
        return f"select:{model}:{self.min_memory or 0}"

    def __str__(self) -> str:
        parts = [] if self.model is None else [f"model {self.model!r}"]
        if self.min_memory is not None:
            parts.append(f"at least {format_memory(self.min_memory)} of memory")
        return " and ".join(parts)


def check_model(value: object) -> str:
    """A ``model``: 1 to ``MODEL_MAX`` printable ASCII characters (``MODEL_RE``)."""
    shape = (
        f"1 to {MODEL_MAX} printable ASCII characters, part of the GPU's product name (e.g. H100)"
    )
    return check_text(value, MODEL_RE, field="model", shape=shape)


def check_min_memory(value: object) -> int:
    """A ``min_memory``: a whole number of bytes above 0."""
    size = json_integer(value)
    if size is None or size < 1:
        raise WireFormatError(
            f"min_memory must be a whole number of bytes greater than 0, got "
            f"{describe_value(value)}",
            field="min_memory",
        )
    return size


def check_selector(
    obj: Mapping[str, object], *, named: bool, mig: bool = False
) -> GpuSelector | None:
    """The selector of an attach body (None: it gives neither member). Refused beside
    ``gpus`` (a named GPU is exact already) and beside ``mig`` (a slice's NVML name is its
    profile's, so a model could not be matched as the user means it; the profile says the
    memory)."""
    present = [name for name in ("model", "min_memory") if name in obj]
    if not present:
        return None
    if named or mig:
        other = "gpus: a named GPU is exact already" if named else "mig: the profile says it"
        raise WireFormatError(
            f"{present[0]} cannot be given with {other}; give one or the other",
            field=present[0],
        )
    return GpuSelector(
        model=check_model(obj["model"]) if "model" in obj else None,
        min_memory=check_min_memory(obj["min_memory"]) if "min_memory" in obj else None,
    )


def parse_memory_text(text: str) -> int:
    """Bytes from what a person types, as Kubernetes reads a quantity: ``G``/``GB`` decimal
    (10**9, the unit a card is sold in: an "80GB" H100, 79.6 GiB by NVML's count, has 80G),
    ``Gi``/``GiB`` binary (2**30), ``512M``, ``1024``."""
    found = _MEMORY_TEXT_RE.fullmatch(text.strip())
    if found is None:
        raise WireFormatError(
            f"min_memory must be a size such as 80G (10**9 bytes), 40Gi (2**30) or 512M, got "
            f"{describe_value(text)}",
            field="min_memory",
        )
    unit, binary = (found[2] or "").lower(), bool(found[3])
    scale: int = (1024 if binary else 1000) ** _MEMORY_POWERS[unit]
    return int(found[1]) * scale


# --- the Kubernetes contract (DESIGN §3): what spawners, manifests and the agent agree on -------

TOKEN_AUDIENCE: Final = "gpu-hotplug"
"""The audience of the projected service-account token a notebook pod sends to the agent."""

MAX_GPUS_ANNOTATION: Final = "gpu-hotplug.jupyter.org/max-gpus"
"""Pod annotation: the most GPUs the pod may hold hot-attached (set by the spawner)."""

IDLE_RELEASE_ANNOTATION: Final = "gpu-hotplug.jupyter.org/idle-release-seconds"
"""Pod annotation: a stricter idle period (seconds) for the pod's GPUs than the agent's own
(set by the platform; a laxer or unreadable value changes nothing)."""

AGENT_PORT: Final = 8477
"""The agent's TCP port in Kubernetes mode (DaemonSet, Service, network policies, spawners)."""

CONTAINER_ANNOTATION: Final = "gpu-hotplug.jupyter.org/container"
"""Pod annotation: which container gets GPUs when a request names none (default: the only one)."""

NODE_NAME_ENV: Final = "NODE_NAME"
"""The agent's node in Kubernetes mode (the DaemonSet sets it from the downward API)."""
