"""``attach_checks``, table-tested like ``admission.decide``: each row is a request against one
node (two whole GPUs, a GPU in MIG mode with three slices, a lost GPU) and what the check must
say — a number, a refusal's code and whether waiting could help, or what it hands back. No host,
allocator or lock: these are the attach's rules as values (``core/attach_checks.py``)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from jupyter_gpu_hotplug._structs import GpuSelector, GpuUuid, PidTarget, RequestId, Target
from jupyter_gpu_hotplug.agent.core import attach_checks as checks
from jupyter_gpu_hotplug.agent.core.admission import Limit
from jupyter_gpu_hotplug.agent.core.errors import AgentError, InvalidRequest
from jupyter_gpu_hotplug.agent.core.inventory import GpuDevice, InventorySnapshot, LostGpu
from jupyter_gpu_hotplug.agent.core.queue import Waiter
from jupyter_gpu_hotplug.agent.core.seams import (
    AttachRequest,
    ContainerCgroups,
    ContainerKey,
    GpuLimit,
    HostContainer,
    Reservation,
    ReservationState,
)
from jupyter_gpu_hotplug.nvml.state import MigSlice

SMALL, LARGE = "1g.10gb", "2g.20gb"
GPU0, GPU1 = (
    GpuUuid("GPU-00000000-0000-0000-0000-000000000000"),
    GpuUuid("GPU-11111111-1111-1111-1111-111111111111"),
)
PARENT = GpuUuid("GPU-22222222-2222-2222-2222-222222222222")
SLICE_A, SLICE_B, SLICE_C = (
    GpuUuid(f"MIG-{digit * 8}-{digit * 4}-{digit * 4}-{digit * 4}-{digit * 12}") for digit in "abc"
)


def _gpu(uuid: GpuUuid, index: int, *, mig: str | None = None, mig_mode: bool = False) -> GpuDevice:
    return GpuDevice(
        uuid=uuid,
        index=index,
        minor=index,
        name="test GPU",
        memory_total=2**30,
        simulated=True,
        mig=None if mig is None else MigSlice(PARENT, mig, index, 0),
        mig_enabled=mig_mode,
    )


WHOLE0, WHOLE1 = _gpu(GPU0, 0), _gpu(GPU1, 1)
IN_MIG_MODE = _gpu(PARENT, 2, mig_mode=True)
A, B, C = _gpu(SLICE_A, 2, mig=SMALL), _gpu(SLICE_B, 2, mig=SMALL), _gpu(SLICE_C, 2, mig=LARGE)
NODE = InventorySnapshot(
    gpus=(WHOLE0, WHOLE1, IN_MIG_MODE, A, B, C),
    lost=(LostGpu(index=3, reason="fell off the bus", last_known=None),),
)
NO_SLICES = InventorySnapshot(gpus=(WHOLE0, WHOLE1))

OURS, THEIRS = ContainerKey("local:ours"), ContainerKey("local:theirs")
OUR_TARGET, THEIR_TARGET = PidTarget(100, 1), PidTarget(200, 1)


def ask(
    count: int = 1,
    *,
    mig: str | None = None,
    gpus: tuple[GpuUuid, ...] = (),
    queued: bool = False,
    request_id: str | None = None,
    selector: GpuSelector | None = None,
) -> AttachRequest:
    return AttachRequest(
        count=count,
        target=None,
        wait_seconds=60,
        request_id=None if request_id is None else RequestId(request_id),
        mig=mig,
        gpus=gpus,
        selector=selector,
        queued=queued,
    )


TEST_MODEL, TOO_LARGE = GpuSelector("Test"), GpuSelector(min_memory=2**30 + 1)
LOST_HOPPER = InventorySnapshot(
    gpus=(WHOLE0,),
    lost=(LostGpu(3, "fell off the bus", replace(WHOLE1, name="NVIDIA H100 80GB HBM3")),),
)


def held(
    gpu: GpuDevice,
    *,
    container: ContainerKey = THEIRS,
    target: Target = THEIR_TARGET,
    request_id: str | None = None,
    state: ReservationState = ReservationState.GRANTED,
) -> Reservation:
    return Reservation(
        gpu=checks.as_record(gpu),
        target=target,
        container=container,
        state=state,
        request_id=None if request_id is None else RequestId(request_id),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        granted_at=None,
    )


def refusal(error: AgentError) -> tuple[str, bool]:
    return error.code, error.retryable


# --- what a request may get ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "mig", "expected"),
    [
        (WHOLE0, None, True),
        (IN_MIG_MODE, None, False),
        (A, None, False),
        (A, SMALL, True),
        (C, SMALL, False),
        (WHOLE0, SMALL, False),
    ],
    ids=[
        "whole GPU, plain",
        "GPU in MIG mode, plain",
        "slice, plain",
        "slice of the profile",
        "slice of another profile",
        "whole GPU, a profile",
    ],
)
def test_what_an_attach_not_naming_its_gpus_may_get(
    gpu: GpuDevice, mig: str | None, expected: bool
) -> None:
    assert checks.serves(gpu, mig) is expected


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (ask(), [GPU0, GPU1]),
        (ask(mig=SMALL), [SLICE_A, SLICE_B]),
        (ask(gpus=(GPU1,)), [GPU1]),
        (ask(selector=TEST_MODEL), [GPU0, GPU1]),
        (ask(selector=GpuSelector(min_memory=2**30)), [GPU0, GPU1]),
        (ask(selector=TOO_LARGE), []),
        (ask(selector=GpuSelector("H100")), []),
    ],
    ids=[
        "whole GPUs",
        "slices of its profile",
        "what it names",
        "whole GPUs of the model",
        "whole GPUs with the memory",
        "none with more memory",
        "none of another model",
    ],
)
def test_the_candidates_the_allocator_is_given(
    request_: AttachRequest, expected: list[GpuUuid]
) -> None:
    assert [gpu.uuid for gpu in checks.candidate_records(NODE, request_)] == expected


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (ask(), None),
        (ask(mig=SMALL), SMALL),
        (ask(gpus=(GPU1, GPU0)), f"{GPU0},{GPU1}"),
        (ask(selector=GpuSelector("H100", 5)), "select:h100:5"),
    ],
    ids=["whole GPUs", "a profile", "named GPUs, in one order", "a selector"],
)
def test_what_a_request_waits_for_in_the_queue(
    request_: AttachRequest, expected: str | None
) -> None:
    assert checks.queue_kind(request_) == expected


# --- its shape -------------------------------------------------------------------------------

SHAPES: list[tuple[str, AttachRequest, InventorySnapshot, int | tuple[str, bool]]] = [
    ("whole GPUs: the healthy and the lost count", ask(), NODE, 3),
    ("slices of a profile", ask(mig=SMALL), NODE, 2),
    ("named GPUs: as many as it names", ask(2, gpus=(GPU0, SLICE_C)), NODE, 2),
    ("a profile the node has no slice of", ask(mig="3g.40gb"), NODE, ("insufficient_gpus", False)),
    ("slices on a node without MIG", ask(mig=SMALL), NO_SLICES, ("insufficient_gpus", False)),
    ("a GPU the node does not have", ask(gpus=(PARENT,)), NO_SLICES, ("not_found", False)),
    ("a GPU in MIG mode, named whole", ask(gpus=(PARENT,)), NODE, ("invalid_request", False)),
    (
        "a slice of another profile",
        ask(mig=SMALL, gpus=(SLICE_C,)),
        NODE,
        ("invalid_request", False),
    ),
    ("a whole GPU, with a profile", ask(mig=SMALL, gpus=(GPU0,)), NODE, ("invalid_request", False)),
    ("a selector: the matching and the unread lost", ask(selector=TEST_MODEL), NODE, 3),
    ("a selector no GPU matches", ask(selector=TOO_LARGE), NO_SLICES, ("insufficient_gpus", False)),
    ("a selector only a lost GPU matched", ask(selector=GpuSelector("H100")), LOST_HOPPER, 1),
    ("a selector a lost GPU did not match", ask(selector=TEST_MODEL), LOST_HOPPER, 1),
]


@pytest.mark.parametrize(
    ("request_", "node", "expected"),
    [row[1:] for row in SHAPES],
    ids=[row[0] for row in SHAPES],
)
def test_the_shape_of_a_request_against_the_node(
    request_: AttachRequest, node: InventorySnapshot, expected: int | tuple[str, bool]
) -> None:
    if isinstance(expected, int):
        assert checks.check_shape(request_, node) == expected
        return
    with pytest.raises(AgentError) as refused:
        checks.check_shape(request_, node)
    assert refusal(refused.value) == expected


def test_a_named_gpu_is_refused_where_the_cluster_picks_the_device() -> None:
    checks.check_selectable(ask(gpus=(GPU0,)), selectable=True)
    checks.check_selectable(ask(), selectable=False)
    checks.check_selectable(ask(selector=TEST_MODEL), selectable=True)
    with pytest.raises(InvalidRequest) as refused:
        checks.check_selectable(ask(gpus=(GPU0,)), selectable=False)
    assert (refused.value.code, refused.value.field) == ("invalid_request", "gpus")


@pytest.mark.parametrize(
    ("mig", "profile", "expected"),
    [(None, None, None), (None, SMALL, SMALL), (SMALL, SMALL, SMALL), (LARGE, None, LARGE)],
    ids=["no profile anywhere", "the agent's", "the same", "the agent has none"],
)
def test_the_agents_one_profile_is_every_requests(
    mig: str | None, profile: str | None, expected: str | None
) -> None:
    assert checks.with_profile(ask(mig=mig), profile).mig == expected


def test_a_request_for_another_profile_than_the_agents_is_refused() -> None:
    with pytest.raises(InvalidRequest) as refused:
        checks.with_profile(ask(mig=LARGE), SMALL)
    assert (refused.value.code, refused.value.field) == ("invalid_request", "mig")


# --- named GPUs that are taken ---------------------------------------------------------------

TAKEN: list[tuple[str, AttachRequest, dict[GpuUuid, Reservation], object]] = [
    ("nothing named is held", ask(gpus=(GPU0,)), {}, None),
    ("another's, at once", ask(gpus=(GPU0,)), {GPU0: held(WHOLE0)}, GPU0),
    ("another's, may wait", ask(gpus=(GPU0,), queued=True), {GPU0: held(WHOLE0)}, None),
    (
        "its own, may wait: never frees for it",
        ask(gpus=(GPU0,), queued=True),
        {GPU0: held(WHOLE0, container=OURS, target=OUR_TARGET)},
        ("insufficient_gpus", False),
    ),
    (
        "the first in the request's order decides",
        ask(2, gpus=(GPU1, GPU0)),
        {GPU0: held(WHOLE0, container=OURS), GPU1: held(WHOLE1)},
        GPU1,
    ),
]


@pytest.mark.parametrize(
    ("request_", "holders", "expected"),
    [row[1:] for row in TAKEN],
    ids=[row[0] for row in TAKEN],
)
def test_a_named_gpu_that_is_taken(
    request_: AttachRequest, holders: dict[GpuUuid, Reservation], expected: object
) -> None:
    if isinstance(expected, tuple):
        with pytest.raises(AgentError) as refused:
            checks.named_taken(request_, OURS, NODE, holders.get, free=1)
        assert refusal(refused.value) == expected
        return
    taken = checks.named_taken(request_, OURS, NODE, holders.get, free=1)
    assert (None if taken is None else taken[0].uuid) == expected


@pytest.mark.parametrize(
    ("seen", "named"),
    [(True, str(THEIR_TARGET)), (False, "another container")],
    ids=["a target the caller may see", "another tenant's"],
)
def test_the_holder_of_a_taken_gpu_is_named_only_to_who_may_see_it(seen: bool, named: str) -> None:
    error = checks.taken_by_another(ask(gpus=(GPU0,)), WHOLE0, held(WHOLE0), free=0, seen=seen)

    assert error.message.startswith(f"GPU 0 ({GPU0}) is attached to {named};")
    assert refusal(error) == ("insufficient_gpus", True)


# --- limits and a repeated request --------------------------------------------------------------


def _waiter(key: ContainerKey, target: PidTarget, count: int) -> Waiter:
    container = HostContainer(
        target=target,
        key=key,
        pid=target.pid,
        start_time=target.start_time,
        cgroups=ContainerCgroups(devices_v1=None, unified=f"/{key}"),
        label=str(key),
    )
    return Waiter(container, count, RequestId("w"), deadline=0.0, queued_at=datetime.now(UTC))


def test_a_limit_counts_what_the_group_holds_and_its_waiters_will_take() -> None:
    reservations = [held(WHOLE0, container=OURS, target=OUR_TARGET), held(WHOLE1)]
    waiters = [_waiter(OURS, OUR_TARGET, 2), _waiter(THEIRS, THEIR_TARGET, 3)]
    pod = GpuLimit(count=4, source="max-gpus", covers=lambda target: target in (OUR_TARGET,))

    alone = checks.limits_of(
        OURS, per_container=2, group=None, reservations=reservations, waiters=waiters
    )
    grouped = checks.limits_of(
        OURS, per_container=2, group=pod, reservations=reservations, waiters=waiters
    )

    assert alone == (Limit(count=2, held=3),)
    assert grouped == (Limit(count=2, held=3), Limit(count=4, held=3, source="max-gpus"))


REPEATS: list[tuple[str, AttachRequest, list[Reservation], object]] = [
    ("no request id", ask(), [held(WHOLE0, request_id="r1")], None),
    ("a new id", ask(request_id="r2"), [held(WHOLE0, request_id="r1")], None),
    ("a retry", ask(request_id="r1"), [held(WHOLE0, request_id="r1")], [GPU0]),
    (
        "the id of another count",
        ask(2, request_id="r1"),
        [held(WHOLE0, request_id="r1")],
        ("invalid_request", False),
    ),
    (
        "one left half-done by a crash",
        ask(request_id="r1"),
        [held(WHOLE0, request_id="r1", state=ReservationState.RESERVING)],
        ("busy", True),
    ),
]


@pytest.mark.parametrize(
    ("request_", "entries", "expected"),
    [row[1:] for row in REPEATS],
    ids=[row[0] for row in REPEATS],
)
def test_a_repeated_request_id(
    request_: AttachRequest, entries: list[Reservation], expected: object
) -> None:
    if isinstance(expected, tuple):
        with pytest.raises(AgentError) as refused:
            checks.repeated(request_, entries)
        assert refusal(refused.value) == expected
        return
    earlier = checks.repeated(request_, entries)
    assert (None if earlier is None else [entry.gpu.uuid for entry in earlier]) == expected
