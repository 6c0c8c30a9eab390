"""The seams between the agent's core and its backends: value types and Protocols, no I/O.

Why it exists: one service (``service.py``) and one reconciler (``reconcile.py``) serve every
backend. What differs between local mode and Kubernetes mode — who holds which GPU durably
(``Allocator``), which running container a target names (``Resolver``), who the caller is and
what it may act on (``Identity``) — sits behind the Protocols below, and the core sees nothing
else of a backend. ``local/`` implements them today (SQLite ledger, pid resolver, peer
credentials and token); ``kubernetes/`` implements the same ones.

The rule every backend keeps: **the owner of a grant is a container, never a pid**. A grant
reaches every process of the container (its device cgroups and its mount namespace), so a
reservation is made to a ``ContainerKey`` and released only after that container's access is
taken back (or the container is gone). ``HostContainer`` is what the injector acts on; nothing
in it comes from a caller unverified.

Refinements of the design in ``SEAMS.md`` (documented here, where the code is):

- ``Resolver.current`` takes the reservation's key as well as its target: local mode cannot
  find "the same container, through another of its processes" from a pid that has exited.
  Kubernetes may ignore the key (the pod and container name say which container is current).
- ``Resolver.remains`` is new: the device cgroups a container left behind with no process in
  them (local mode's empty cgroups keep their grant), so the reconciler can withdraw the grant
  before it returns the GPU to the pool. Kubernetes returns None (the runtime removes them).
- ``Identity.bind_connection`` is new: the API calls it once per accepted connection, with the
  peer's credentials and a pidfd (unix socket), and keeps the ``ConnectionInfo`` it returns for
  every request on that connection: identity is bound at accept, never looked up later from a
  pid that may have been reused.
- ``Identity.self_target`` blocks (local mode reads ``/proc``): the service calls it in the
  worker pool.
- ``Allocator.mark_granted`` records ``nodes_created`` (``Reservation.node_created``): the
  agent removes only device nodes it created (Kubernetes: keep it in the holder's annotations);
  ``Allocator.intend_grant`` records the intent before the grant makes them, so a crash between
  the two still leaves the node known as the agent's. A backend whose writes are dear may record
  the grant itself there (Kubernetes: one PATCH of the holder, ``kubernetes/allocator.py``): a
  restart then finishes the attach instead of rolling it back.
- ``Caller`` also carries ``cgroups`` (local mode's authorization compares them: a caller may
  act on a target whose cgroups are its own or an ancestor's, which is what a grant reaches)
  and the ``connection`` it came on; ``Verb`` is ``get | create | delete``.
- The injector (``injector.py``, not a backend seam: one adapter over ``linux.engine`` for
  every backend) returns from ``grant`` the names of the nodes it created, takes
  ``keep_nodes`` in ``revoke`` (nodes it did not create stay), and has ``withdraw(cgroups,
  nodes)`` for the empty cgroups of ``Resolver.remains``.
- ``Allocator.begin_release``/``cancel_release``/``mark_granted`` take several uuids at once;
  ``Allocator.known_gpus`` is left out (the reconciler takes the GPUs from the inventory and
  the reservations).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, NewType, Protocol

from ..._structs import GpuSelector, GpuUuid, RequestId, Target, TargetRef
from .errors import Busy, NotFound

__all__ = [
    "TRANSITIONS",
    "Allocator",
    "AttachRequest",
    "Caller",
    "ConnectionInfo",
    "ContainerCgroups",
    "ContainerKey",
    "GpuLimit",
    "GpuRecord",
    "HostContainer",
    "Identity",
    "IllegalTransition",
    "PeerCredentials",
    "PodIdentity",
    "Reservation",
    "ReservationState",
    "Resolver",
    "Suspension",
    "SuspensionBook",
    "SuspensionState",
    "TargetPolicy",
    "Transition",
    "Verb",
    "plan_transition",
]

ContainerKey = NewType("ContainerKey", str)
"""Stable identity of a running container: survives agent restarts, changes when the container
is replaced. Local: ``local:`` + its device cgroups and their cgroup ids (directory inodes,
which the kernel never reuses for a new cgroup). Kubernetes: the runtime's container id
(``containerd://<64 hex>``). The core only compares keys; each backend parses its own."""

Verb = Literal["get", "create", "delete"]


@dataclass(frozen=True)
class ContainerCgroups:
    """The device cgroups of a container, as ``/proc/<pid>/cgroup`` names them (crun's inner
    ``container`` leaf folded into its scope). ``None``: the hierarchy is not in use."""

    devices_v1: str | None
    unified: str | None

    @property
    def in_root_cgroup(self) -> bool:
        """In the root of a hierarchy: no container confines it."""
        return "/" in (self.devices_v1, self.unified)

    def within(self, other: ContainerCgroups) -> bool:
        """Whether these cgroups are ``other``'s or below them in every hierarchy in use: what
        a grant to ``other`` reaches (a v1 allow is written to the scope and every descendant)."""
        return _below(self.devices_v1, other.devices_v1) and _below(self.unified, other.unified)

    def __str__(self) -> str:
        parts = [
            f"{name}:{path}"
            for name, path in (("devices", self.devices_v1), ("unified", self.unified))
            if path is not None
        ]
        return ", ".join(parts) or "no device cgroup"


def _below(path: str | None, top: str | None) -> bool:
    if path is None or top is None:
        return path == top
    return path == top or path.startswith(top.rstrip("/") + "/")


@dataclass(frozen=True)
class HostContainer:
    """A target resolved to the running container the agent acts on: everything the injector
    needs, nothing in it taken from the caller unverified."""

    target: Target
    """The canonical API target (``PidTarget`` with its start time, or a ``PodTarget`` with
    its container filled in)."""
    key: ContainerKey
    pid: int
    """A live process of the container, in the agent's (the host's) pid namespace."""
    start_time: int
    """That process's start time (``/proc/<pid>/stat`` field 22): detects pid reuse."""
    cgroups: ContainerCgroups
    label: str
    """What a person recognises: ``process 123 (python)``, ``pod ns/name (container c)``."""

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class AttachRequest:
    """A validated ``POST /v1/attachments``; ``target=None`` means "the caller itself"."""

    count: int
    target: TargetRef | None
    wait_seconds: float
    request_id: RequestId | None
    idle_release_seconds: float | None = None
    """A stricter idle period for these GPUs than the agent's own (``idle_releaser.py``)."""
    mig: str | None = None
    """A MIG profile (``1g.10gb``): attach that many slices of it instead of whole GPUs."""
    gpus: tuple[GpuUuid, ...] = ()
    """The GPUs (or MIG slices) to attach, ``count`` of them; empty: any free ones. Only an
    allocator that is ``selectable`` can honour it."""
    selector: GpuSelector | None = None
    """What each GPU must be (model, memory); never with ``gpus`` or ``mig``. Like ``gpus``,
    only a ``selectable`` allocator can honour it."""
    queued: bool = False
    """The request gave ``wait_seconds``: it waits in the queue when too few GPUs are free
    (``core/queue.py``); without it, it is answered at once."""


# --- the allocator -------------------------------------------------------------------------------


class ReservationState(enum.StrEnum):
    """A reservation's life: made before the host is touched, granted once it is, announced
    before it is undone. ``TRANSITIONS`` below is the one table of what may follow what; every
    allocator enforces it through ``then`` and ``plan_transition``."""

    RESERVING = "reserving"
    GRANTED = "granted"
    RELEASING = "releasing"

    def then(self, transition: Transition) -> ReservationState | Refusal:
        """The state ``transition`` leads to from this one, or how it is refused."""
        return TRANSITIONS[transition, self]


class Transition(enum.StrEnum):
    """The state changes an allocator makes on request, each the ``Allocator`` method of that
    name (``reserve`` creates a reservation, ``release`` and ``rebind`` take any state)."""

    MARK_GRANTED = "mark_granted"
    BEGIN_RELEASE = "begin_release"
    CANCEL_RELEASE = "cancel_release"


class IllegalTransition(Exception):
    """A state change no correct caller asks for (granting what is being released, cancelling
    a release that never began): a bug in the caller, so the API answers 500. Nothing changed."""


Refusal = type[Busy] | type[NotFound] | type[IllegalTransition]
"""How the table refuses a transition: ``Busy`` (409: the attach is still under way, try again),
``NotFound`` (404: nothing to release), ``IllegalTransition`` (500: a bug)."""

TRANSITIONS: Mapping[tuple[Transition, ReservationState | None], ReservationState | Refusal] = {
    # From no reservation at all (None): only a release can be asked for by a client's mistake.
    (Transition.MARK_GRANTED, None): IllegalTransition,
    (Transition.BEGIN_RELEASE, None): NotFound,
    (Transition.CANCEL_RELEASE, None): IllegalTransition,
    (Transition.MARK_GRANTED, ReservationState.RESERVING): ReservationState.GRANTED,
    (Transition.BEGIN_RELEASE, ReservationState.RESERVING): Busy,
    (Transition.CANCEL_RELEASE, ReservationState.RESERVING): IllegalTransition,
    # Repeating a transition that already happened changes nothing (a retried step).
    (Transition.MARK_GRANTED, ReservationState.GRANTED): ReservationState.GRANTED,
    (Transition.BEGIN_RELEASE, ReservationState.GRANTED): ReservationState.RELEASING,
    (Transition.CANCEL_RELEASE, ReservationState.GRANTED): ReservationState.GRANTED,
    (Transition.MARK_GRANTED, ReservationState.RELEASING): IllegalTransition,
    (Transition.BEGIN_RELEASE, ReservationState.RELEASING): ReservationState.RELEASING,
    (Transition.CANCEL_RELEASE, ReservationState.RELEASING): ReservationState.GRANTED,
}
"""Every (transition, current state) pair: the state it leads to, or the error it raises."""


def plan_transition(
    transition: Transition,
    uuids: Collection[GpuUuid],
    current: Callable[[GpuUuid], Reservation | None],
) -> dict[GpuUuid, ReservationState]:
    """The state each of ``uuids`` moves to under ``transition`` (``current`` reads a
    reservation), or the table's error for the first one that may not move: an allocator calls
    this before it changes anything, so a refused call changes none of them."""
    plan: dict[GpuUuid, ReservationState] = {}
    for uuid in uuids:
        entry = current(uuid)
        outcome = TRANSITIONS[transition, None] if entry is None else entry.state.then(transition)
        if isinstance(outcome, ReservationState):
            plan[uuid] = outcome
        elif entry is None:
            if outcome is NotFound:
                raise NotFound("attachment", uuid)
            raise IllegalTransition(f"{transition} of {uuid}: it is not reserved")
        elif outcome is Busy:
            raise Busy.operation_in_progress(str(entry.target))
        else:
            raise IllegalTransition(f"{transition} of {uuid}: it is {entry.state}")
    return plan


@dataclass(frozen=True)
class GpuRecord:
    """What an allocator remembers of a GPU: enough to revoke it even after it left NVML's
    view."""

    uuid: GpuUuid
    index: int
    minor: int
    name: str


@dataclass(frozen=True)
class Reservation:
    """One GPU held for one target's container."""

    gpu: GpuRecord
    target: Target
    container: ContainerKey
    """The container the grant was made to (re-bound when it is re-injected elsewhere)."""
    state: ReservationState
    request_id: RequestId | None
    created_at: datetime
    granted_at: datetime | None
    holder: str | None = None
    """``ns/holder-pod`` in Kubernetes; None locally."""
    node_created: bool = False
    """The grant created the GPU's device node in the container, so a release removes it. A
    node that was there before (put there by the container's runtime) is never removed."""


class Allocator(Protocol):
    """Who holds which GPU, durably. Reads come from memory; writes are awaited.

    Errors: ``InsufficientGpus`` (nothing reserved), ``Timeout`` (deadline passed; nothing left
    behind); from ``mark_granted``, ``begin_release`` and ``cancel_release`` exactly what
    ``TRANSITIONS`` says (checked with ``plan_transition`` before anything changes, so a refused
    call changes none of its uuids); storage trouble as the backend's own exception (a 500: a
    bug or a broken node). Request ids are recorded, never interpreted: whether an attach
    repeats an earlier one is the service's decision, made once, under the target's lock.
    """

    @property
    def selectable(self) -> bool:
        """Whether ``reserve`` takes exactly the ``candidates`` it is given, so that a request
        may name its GPUs (local: the ledger does), or the cluster picks among them
        (Kubernetes: the kubelet's device plugin chooses the device of a holder pod)."""

    async def load(self) -> None:
        """Rebuild the in-memory view from durable state (at start)."""

    async def reserve(
        self,
        container: HostContainer,
        count: int,
        *,
        request_id: RequestId | None,
        deadline: float,
        candidates: Sequence[GpuRecord],
    ) -> list[Reservation]:
        """Take ``count`` of ``candidates`` for ``container`` (state ``RESERVING``), all or
        nothing, recording ``request_id`` on each. ``deadline`` is a ``time.monotonic()``
        value."""

    async def intend_grant(
        self, uuids: Collection[GpuUuid], *, nodes_created: Collection[GpuUuid] = ()
    ) -> None:
        """Record, before the grant, that these ``RESERVING`` GPUs are about to be granted and
        that the grant will create the device nodes of ``nodes_created``
        (``Reservation.node_created``; GPUs in other states unchanged): an agent killed after
        the ``mknod`` then knows the node is its own and removes it when it releases the GPU.
        The reservations stay ``RESERVING`` until ``mark_granted``. What a restart does with
        them is the backend's: rolled back (the local ledger: ``RESERVING`` durably) or
        finished (the holder allocator writes ``granted`` here, its one write after the
        create); either keeps every GPU reserved wherever it may be usable."""

    async def mark_granted(
        self, uuids: Collection[GpuUuid], *, nodes_created: Collection[GpuUuid] = ()
    ) -> list[Reservation]:
        """``Transition.MARK_GRANTED`` (``RESERVING`` → ``GRANTED``), recording for which of
        them the grant created the device node (``Reservation.node_created``)."""

    async def begin_release(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        """``Transition.BEGIN_RELEASE`` (``GRANTED`` → ``RELEASING``)."""

    async def cancel_release(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        """``Transition.CANCEL_RELEASE`` (``RELEASING`` → ``GRANTED``): the release did not
        happen."""

    async def release(self, uuids: Collection[GpuUuid]) -> None:
        """Return the GPUs to the pool (any state; unknown uuids are ignored). Call only once
        no container can open them any more."""

    async def rebind(
        self, uuids: Collection[GpuUuid], container: HostContainer
    ) -> list[Reservation]:
        """Make ``container`` (and its target) the holder of these reservations: the GPUs were
        granted to it because the container they were granted to lives on under another
        process (local) or was replaced (Kubernetes)."""

    def attachments_of(self, target: Target) -> list[Reservation]:
        """The target's reservations (any state), in GPU index order."""

    def all_attachments(self) -> list[Reservation]:
        """Every reservation, in GPU index order."""

    def get(self, uuid: GpuUuid) -> Reservation | None:
        """The reservation of one GPU, if it has one."""

    async def available(self, candidates: Sequence[GpuRecord]) -> list[GpuRecord]:
        """Which of ``candidates`` (NVML's GPUs a request may get) are free now: the one
        authority on "free" the attach decision reads (``admission.py``). Local: those no
        reservation holds. Kubernetes: those no pod of the node holds, as the kubelet's
        PodResources tells (the device plugin's own pods included, which no reservation
        shows)."""

    async def check(self) -> None:
        """A cheap read of the durable store (the health probe)."""


# --- the resolver --------------------------------------------------------------------------------


class Resolver(Protocol):
    """From what a request names to the running container the agent acts on. Calls block
    (``/proc``, a runtime API); the core runs them in its worker pool."""

    def resolve(self, ref: TargetRef) -> HostContainer:
        """The container ``ref`` names now. ``NotFound`` (no such process/pod/container),
        ``Forbidden`` (not a container the agent may touch: a root cgroup, the agent's own
        cgroup, the agent's own mount namespace), ``TargetNotReady`` (not running, a VM
        runtime), ``InvalidRequest`` (a kind of target this backend does not serve)."""

    def lookup(self, target: Target, key: ContainerKey) -> HostContainer | None:
        """The same target in the same container if it still runs, else None (it is gone).
        ``LookupFailed`` when that cannot be told now (the API server or the container
        runtime did not answer): the caller keeps everything as it is and looks again."""

    def current(self, target: Target, key: ContainerKey) -> HostContainer | None:
        """The container that holds the reservation now: the same container through another
        of its processes when ``target``'s process exited (local), or the container that
        replaced it after a restart (Kubernetes: a new key). None: nothing to hold it.
        ``LookupFailed`` as for ``lookup``."""

    def remains(self, key: ContainerKey) -> ContainerCgroups | None:
        """The device cgroups a container with no process left behind, if they still exist
        (their grants must be withdrawn before the GPU returns to the pool); else None."""


# --- the target policy ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuLimit:
    """The most GPUs a group of targets may hold together (Kubernetes: the containers of one
    pod), beyond the agent's per-container limit, and where that number comes from."""

    count: int
    source: str
    """For the refusal's message: which setting or annotation to change."""
    covers: Callable[[Target], bool]
    """Whether a target (of a reservation, of a waiting request) is in the group."""


class TargetPolicy(Protocol):
    """Whether a target may get GPUs at all, and how many its group may hold: the operator's
    decisions about tenants (Kubernetes: the namespace allowlist and the per-pod limit), taken
    once per attach, after the caller is authorized and before anything is reserved."""

    async def gpu_limit(self, container: HostContainer) -> GpuLimit:
        """The limit of ``container``'s group; ``Forbidden`` (403) when it may have none."""


# --- the identity --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerCredentials:
    """The process at the other end of a unix socket, as the kernel recorded it at connect."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class ConnectionInfo:
    """What the API learnt about a connection when it accepted it (``Identity.bind_connection``)."""

    transport: Literal["unix", "tcp"]
    peer: PeerCredentials | None = None
    container: ContainerKey | None = None
    """The peer's container, resolved at accept while a pidfd proved the peer alive; None over
    TCP, or when the peer was gone or in no container by then."""
    cgroups: ContainerCgroups | None = None
    """That container's device cgroups (local mode's authorization compares them)."""


@dataclass(frozen=True)
class PodIdentity:
    """A pod, as a bound service-account token names it (Kubernetes)."""

    namespace: str
    name: str
    uid: str
    """The pod's uid: a pod acts on itself only while the target pod has it, so a token of a
    deleted pod never acts on a new pod of the same name."""


@dataclass(frozen=True)
class Caller:
    """An authenticated caller."""

    description: str
    """For logs and messages: ``pid 123 uid 0``, ``pod ns/name``, ``token``."""
    container: ContainerKey | None = None
    """Local unix socket: the caller's container, bound at accept."""
    cgroups: ContainerCgroups | None = None
    """Local unix socket: that container's device cgroups."""
    pod: PodIdentity | None = None
    """Kubernetes: the pod of the bound token."""
    privileged: bool = False
    """May act on any target the resolver accepts (local mode's agent token)."""
    connection: ConnectionInfo | None = None
    """What the connection was bound to (the identity's own reference)."""

    def __str__(self) -> str:
        return self.description


class Identity(Protocol):
    """Who the caller is, and what it may act on."""

    def bind_connection(self, *, peer: PeerCredentials | None, pidfd: int | None) -> ConnectionInfo:
        """Called once when a connection is accepted (``peer``/``pidfd``: unix socket only;
        the pidfd is closed by the caller afterwards). Must not block for long."""

    async def authenticate(
        self, *, authorization: str | None, connection: ConnectionInfo
    ) -> Caller:
        """The caller of one request, or ``Unauthenticated`` (401)."""

    async def authenticate_reader(
        self, *, authorization: str | None, connection: ConnectionInfo, path: str
    ) -> Caller:
        """The caller of a read of the agent's own ``path`` (``/metrics``,
        ``/v1/openapi.json``): ``Unauthenticated`` (401), or ``Forbidden`` (403) when it may
        not read it. These describe the node and the agent, not a target: the monitoring
        system and operators read them, never an anonymous client."""

    async def authorize(self, caller: Caller, verb: Verb, target: HostContainer) -> None:
        """``Forbidden`` (403) unless ``caller`` may do ``verb`` on ``target``."""

    async def may_see(self, caller: Caller, target: Target) -> bool:
        """Whether ``caller`` may learn who holds a GPU when ``target`` does (``/v1/gpus``
        names it then; else the GPU shows as taken, by nobody named)."""

    def self_target(self, caller: Caller) -> TargetRef:
        """What a request without a target means ("the caller itself"); ``InvalidRequest``
        when the caller has no such thing (local TCP). May block: runs in the worker pool."""


# --- suspended CUDA state (issue 39) -----------------------------------------------------------


class SuspensionState(enum.StrEnum):
    """Where a target's suspension is, as recorded *before* the step it announces."""

    SUSPENDING = "suspending"
    """Recorded before the first lock: its processes may be locked or checkpointed while its
    GPUs are still granted. A restart rolls it back (``suspend.Suspender.recover``)."""
    SUSPENDED = "suspended"
    """Its processes are checkpointed and its GPUs released: the next attach resumes them."""


@dataclass(frozen=True)
class Suspension:
    """A target whose CUDA processes the agent checkpointed, to resume on its next attach."""

    target: Target
    container: ContainerKey
    model: str
    """The product name of its GPUs: a resume takes GPUs of exactly this name (the driver
    restores only onto the same chip type)."""
    gpus: tuple[GpuRecord, ...]
    """The GPUs it held, in order: a resume prefers them and pairs each old UUID with a new."""
    pids: tuple[int, ...]
    """Its CUDA processes, as the agent (the host) numbers them."""
    state: SuspensionState
    host_memory: int | None = None
    """Bytes of device memory kept in host memory, as the driver (the simulated one) or else
    NVML says; None when neither does (a suspend under a budget is then refused)."""


class SuspensionBook(Protocol):
    """Where suspensions are kept durably (local mode: the ledger). Calls block: run them in
    the ledger's thread (``Workers.ledger``)."""

    def record_suspension(self, suspension: Suspension) -> None:
        """Write ``suspension``, replacing the target's earlier one."""

    def suspension(self, target: Target) -> Suspension | None:
        """The target's suspension, if it has one."""

    def suspensions(self) -> list[Suspension]:
        """Every suspension (a restart's recovery reads them)."""

    def forget_suspension(self, target: Target) -> None:
        """Drop the target's suspension (none: nothing to do)."""
