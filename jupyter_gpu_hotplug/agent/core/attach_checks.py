"""An attach request against the node's GPUs: what it may get, and why it may not.

Why it exists: the checks of one attach — which GPUs a request may get (whole ones, slices of a
profile, the ones it names), whether the node can ever serve its shape, whether a GPU it names
is taken and by whom, which limits its container's group is under — are rules about values,
not steps of an operation. Written as pure functions of the request, the inventory and the
books they are given, each is table-tested (``tests/agent/test_attach_checks.py``) without a
host, an allocator or a lock, and the service (``service.py``) only calls them in order. The
weighing of the numbers is ``admission.decide``'s; these functions only build its inputs and
refuse what no waiting can fix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from ..._structs import GpuSelector, GpuUuid, Target, format_memory
from .admission import Limit
from .errors import Busy, InsufficientGpus, InvalidRequest, NotFound
from .inventory import GpuDevice, InventorySnapshot
from .queue import Waiter
from .seams import (
    AttachRequest,
    ContainerKey,
    GpuLimit,
    GpuRecord,
    Reservation,
    ReservationState,
)

__all__ = [
    "as_record",
    "candidate_records",
    "candidates",
    "check_named",
    "check_selectable",
    "check_shape",
    "describe",
    "limits_of",
    "named_taken",
    "queue_kind",
    "repeated",
    "selected",
    "serves",
    "taken_by_another",
    "with_profile",
]


def serves(gpu: GpuDevice, mig: str | None) -> bool:
    """Whether an attach for MIG profile ``mig`` (``None``: whole GPUs) may get ``gpu``. The
    one rule for what an attach not naming its GPUs gets, and so for what ``GET /v1/gpus``
    calls ``plain_attach`` (with the agent's own profile, ``with_profile``)."""
    if mig is None:
        return gpu.whole
    return gpu.mig is not None and gpu.mig.profile == mig


def as_record(gpu: GpuDevice) -> GpuRecord:
    """A GPU of the inventory as the allocator takes it."""
    return GpuRecord(gpu.uuid, gpu.index, gpu.minor, gpu.name)


def selected(gpu: GpuDevice, selector: GpuSelector | None) -> bool:
    """Whether ``gpu`` is what a request's selector (None: any) asks for."""
    return selector is None or selector.matches(gpu.name, gpu.memory_total)


def queue_kind(request: AttachRequest) -> str | None:
    """What a request waits for in the queue (``Waiter.kind``): its named GPUs, or whole GPUs
    of its selector (so that a waiter for an H100 does not hold up one for any GPU), or
    slices of its MIG profile."""
    if request.gpus:
        return ",".join(sorted(request.gpus))
    return request.mig if request.selector is None else request.selector.key


def describe(gpu: GpuDevice) -> str:
    """A GPU as a person finds it in the panel and ``nvidia-smi``: by its index."""
    if gpu.mig is None:
        return f"GPU {gpu.index} ({gpu.uuid})"
    return f"MIG slice {gpu.uuid} of GPU {gpu.index}"


def repeated(
    request: AttachRequest, target_entries: Sequence[Reservation]
) -> list[Reservation] | None:
    """The reservations an attach with ``request``'s id already made for its target (a client
    retrying after a timeout is answered with them and gets no second GPU), or None for a new
    request. The one idempotency check of the agent: allocators record request ids and never
    interpret them, and the service asks it under the target's lock, so no two attaches with
    one id reserve twice. 400 when the id was used for another count; 409 ``busy`` while those
    reservations are neither done nor undone (left by a crash, not yet reconciled)."""
    request_id, count = request.request_id, request.count
    if request_id is None:
        return None
    earlier = [entry for entry in target_entries if entry.request_id == request_id]
    if not earlier:
        return None
    if len(earlier) != count:
        raise InvalidRequest.request_id_reused(request_id, used=len(earlier), requested=count)
    if any(entry.state is ReservationState.RESERVING for entry in earlier):
        raise Busy.operation_in_progress(str(earlier[0].target))
    return earlier


def check_selectable(request: AttachRequest, *, selectable: bool) -> None:
    """Refuse (400) a request naming its GPUs where the cluster, not the agent, picks them
    (``Allocator.selectable``): it could only ever get others than it named."""
    if request.gpus and not selectable:
        raise InvalidRequest(
            "this agent cannot attach a GPU the request names: the cluster picks the "
            "device (the kubelet's device plugin chooses the GPU of each holder pod)",
            field="gpus",
            hint='leave "gpus" out and give only count; GET /v1/gpus marks such GPUs '
            '"selectable": false',
        )
    if request.selector is not None and not selectable:
        raise InvalidRequest(
            "selecting GPUs by model or memory needs DRA (--allocation dra); the device plugin "
            "picks the device itself",
            field="model" if request.selector.model is not None else "min_memory",
            hint='leave "model" and "min_memory" out and give only count',
        )


def with_profile(request: AttachRequest, profile: str | None) -> AttachRequest:
    """``request`` with the agent's MIG ``profile``, where the agent hands out only that one
    (Kubernetes mode with a MIG resource name); 400 for a request of another profile."""
    if profile is None or request.mig == profile:
        return request
    if request.mig is None:
        return replace(request, mig=profile)
    raise InvalidRequest(
        f"this agent hands out MIG slices of profile {profile} only, not {request.mig}",
        field="mig",
        hint=f'leave "mig" out or give "{profile}"',
    )


def candidates(snapshot: InventorySnapshot, request: AttachRequest) -> list[GpuDevice]:
    """What a request may get: the GPUs it names (``check_shape`` checked that they can be
    handed out), else whole GPUs (those its selector matches), or the MIG slices of its
    profile."""
    if request.gpus:
        return [gpu for gpu in snapshot.gpus if gpu.uuid in request.gpus]
    return [
        gpu for gpu in snapshot.gpus if serves(gpu, request.mig) and selected(gpu, request.selector)
    ]


def candidate_records(snapshot: InventorySnapshot, request: AttachRequest) -> list[GpuRecord]:
    """``candidates`` as the allocator takes them."""
    return [as_record(gpu) for gpu in candidates(snapshot, request)]


def check_shape(request: AttachRequest, snapshot: InventorySnapshot) -> int:
    """How many GPUs of the kind asked for the node has in all (``Availability.total``),
    once what the request names can be handed out (``check_named``) and, for MIG slices,
    the node has slices of its profile (else 409, not retryable: no wait helps)."""
    if request.gpus:
        return check_named(request, snapshot)
    total = len(candidates(snapshot, request))
    if request.mig is None:
        # A lost GPU may come back: it counts where it matched, or where it was never read.
        lost = [
            gpu
            for gpu in snapshot.lost
            if gpu.last_known is None or selected(gpu.last_known, request.selector)
        ]
        if total == 0 and request.selector is not None and not lost:
            raise _unmatched(request.selector, request.count, snapshot)
        return total + len(lost)
    if total == 0:
        profiles = sorted({g.mig.profile or "?" for g in snapshot.gpus if g.mig})
        raise InsufficientGpus(
            free=0,
            requested=request.count,
            hint=f"this node has no MIG slice of profile {request.mig}: its slices are "
            f"{', '.join(profiles)}"
            if profiles
            else f"this node has no MIG slice of profile {request.mig}: no GPU of "
            "this node is in MIG mode",
            retryable=False,
        )
    return total


def _unmatched(selector: GpuSelector, count: int, snapshot: InventorySnapshot) -> InsufficientGpus:
    """409, not retryable: no GPU of the node, free or not, is what ``selector`` asks for;
    the message says what the node has, so the user can ask again for that."""
    kinds = Counter(
        f"{gpu.name} ({format_memory(gpu.memory_total)})" for gpu in snapshot.gpus if gpu.whole
    )
    has = ", ".join(f"{kind} x{number}" for kind, number in sorted(kinds.items())) or "no whole GPU"
    return InsufficientGpus(
        free=0,
        requested=count,
        message=f"no GPU of this node matches {selector} (the node has: {has})",
        hint="ask for a model or memory this node has, or leave model and min_memory out",
        retryable=False,
    )


def check_named(request: AttachRequest, snapshot: InventorySnapshot) -> int:
    """How many GPUs a request naming its GPUs may get (all it names), once each is known to
    be a healthy GPU of the node (else 404 ``gpu``) that can be handed out alone: a whole GPU,
    or a MIG slice, of ``request.mig``'s profile when it gives one (else 400 ``gpus``)."""
    devices = {gpu.uuid: gpu for gpu in snapshot.gpus}
    for uuid in request.gpus:
        gpu = devices.get(uuid)
        if gpu is None:
            raise NotFound(
                "gpu",
                uuid,
                hint="list the node's GPUs (GET /v1/gpus) and name one of them"
                + (f"; {len(snapshot.lost)} GPU(s) of the node are lost" if snapshot.lost else ""),
            )
        if gpu.mig is None and not gpu.whole:
            raise InvalidRequest(
                f"{describe(gpu)} is in MIG mode: it is handed out only as its MIG slices",
                field="gpus",
                hint="name one of its slices (MIG-...) instead",
            )
        if request.mig is not None and (gpu.mig is None or gpu.mig.profile != request.mig):
            raise InvalidRequest(
                f"{describe(gpu)} is not a MIG slice of profile {request.mig}",
                field="gpus",
                hint='leave "mig" out: a MIG- UUID names its slice by itself',
            )
    return len(request.gpus)


def named_taken(
    request: AttachRequest,
    container: ContainerKey,
    snapshot: InventorySnapshot,
    holder_of: Callable[[GpuUuid], Reservation | None],
    *,
    free: int,
) -> tuple[GpuDevice, Reservation] | None:
    """The first GPU the request names that another container holds, with its reservation,
    when the request may not wait for it (the caller refuses it with ``taken_by_another``,
    once it knows whether it may name the holder); None when nothing named is in the way.

    One the container holds already never frees for it: refused at once (409, not
    retryable). One of another container is no refusal for a request that may wait: it waits
    for that GPU."""
    devices = {gpu.uuid: gpu for gpu in snapshot.gpus}
    for uuid in request.gpus:
        entry = holder_of(uuid)
        if entry is None:
            continue
        if entry.container == container:
            raise InsufficientGpus(
                free=free,
                requested=request.count,
                message=f"{describe(devices[uuid])} is already attached to {entry.target}",
                hint="it is yours already; name another GPU, or leave gpus out",
                retryable=False,
            )
        if not request.queued:
            return devices[uuid], entry
    return None


def taken_by_another(
    request: AttachRequest, gpu: GpuDevice, entry: Reservation, *, free: int, seen: bool
) -> InsufficientGpus:
    """The refusal of a request naming ``gpu``, which ``entry``'s container holds: saying by
    whom only where the caller may see that target (``Identity.may_see``, ``seen``); to anyone
    else it is "another container", never named."""
    return InsufficientGpus(
        free=free,
        requested=request.count,
        message=f"{describe(gpu)} is attached to {entry.target if seen else 'another container'}",
        hint="name a free GPU, or ask with wait_seconds to wait until this one is free",
    )


def limits_of(
    container: ContainerKey,
    *,
    per_container: int,
    group: GpuLimit | None,
    reservations: Iterable[Reservation],
    waiters: Iterable[Waiter],
) -> tuple[Limit, ...]:
    """The container's limits as the backend resolved them: the agent's per-container setting,
    and its group's (``TargetPolicy``: a pod's ``max-gpus``), each with what the group holds
    and its waiting requests will take: each was admitted when it joined the queue, not again
    at its turn, so what it waits for counts as held."""
    entries, waiting = list(reservations), list(waiters)

    def held(covers: Callable[[ContainerKey, Target], bool]) -> int:
        return sum(1 for e in entries if covers(e.container, e.target)) + sum(
            w.count for w in waiting if covers(w.container.key, w.container.target)
        )

    own = Limit(count=per_container, held=held(lambda key, _: key == container))
    if group is None:
        return (own,)
    return (
        own,
        Limit(
            count=group.count,
            held=held(lambda _, target: group.covers(target)),
            source=group.source,
        ),
    )
