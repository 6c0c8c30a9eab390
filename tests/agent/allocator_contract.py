"""The ``Allocator`` contract, as a reusable suite: every backend's allocator must pass it.

Use: subclass ``AllocatorContract`` in a ``test_*.py`` module as ``class TestMine(...)`` and
define a fixture ``allocator_setup`` returning an ``AllocatorSetup`` — how to open a fresh
allocator over the backend's durable state (each ``open()`` is a new instance, as after an agent
restart), at least three distinct containers to reserve for, and at least four candidate GPUs.
The local ledger runs it in ``test_allocator.py``; the Kubernetes allocator runs it against the
fake API server and the kubelet simulator.

What it proves: reservations are all or nothing; request ids are recorded (their meaning is the
service's); too few free GPUs or a deadline already passed reserve nothing; a release frees;
every state survives a fresh instance's ``load()`` (crash safety); concurrent reservers never
share a GPU; every (transition, state) pair of ``seams.TRANSITIONS`` leads where the table says
or raises its error, durably, and a refused call changes none of its GPUs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, RequestId
from jupyter_gpu_hotplug.agent.core.errors import Busy, InsufficientGpus, NotFound, Timeout
from jupyter_gpu_hotplug.agent.core.seams import (
    TRANSITIONS,
    Allocator,
    GpuRecord,
    HostContainer,
    IllegalTransition,
    Reservation,
    ReservationState,
    Transition,
)

__all__ = ["AllocatorContract", "AllocatorSetup"]


@dataclass
class AllocatorSetup:
    open: Callable[[], Awaitable[Allocator]]
    """A new instance over the same durable state, not yet loaded."""
    containers: Sequence[HostContainer]
    """At least one more than there are candidates, of distinct targets."""
    candidates: Sequence[GpuRecord]
    """At least four GPUs of the node, in index order."""
    finishes_intended: bool = False
    """The allocator records the grant itself with its intent (``intend_grant``: the holder
    allocator's one write after the create), so a restart *finishes* an intended attach (its
    reservation comes back ``GRANTED``) and a reservation never intended does not outlive a
    restart (nothing was granted: its holder knows no GPU and is deleted at load). Otherwise
    ``RESERVING`` is durable as it is (the ledger) and the reconciler rolls it back."""


def _after_restart(
    setup: AllocatorSetup, state: ReservationState | None
) -> ReservationState | None:
    """What a fresh instance makes of a reservation left in ``state`` without an intent."""
    if setup.finishes_intended and state is ReservationState.RESERVING:
        return None
    return state


async def _loaded(setup: AllocatorSetup) -> Allocator:
    allocator = await setup.open()
    await allocator.load()
    return allocator


def _uuids(entries: Sequence[Reservation]) -> set[str]:
    return {entry.gpu.uuid for entry in entries}


async def _reserve(
    allocator: Allocator,
    setup: AllocatorSetup,
    container: HostContainer,
    count: int,
    *,
    request_id: str | None = None,
) -> list[Reservation]:
    return await allocator.reserve(
        container,
        count,
        request_id=None if request_id is None else RequestId(request_id),
        deadline=time.monotonic() + 60,
        candidates=setup.candidates,
    )


async def _in_state(
    allocator: Allocator, setup: AllocatorSetup, state: ReservationState | None, *, index: int = 0
) -> GpuUuid:
    """A GPU whose reservation is in ``state`` (None: a candidate nobody reserved), made for
    ``setup.containers[index]`` through the transitions themselves."""
    if state is None:
        return setup.candidates[-1].uuid
    (entry,) = await _reserve(allocator, setup, setup.containers[index], 1)
    uuid = entry.gpu.uuid
    if state is not ReservationState.RESERVING:
        await allocator.mark_granted([uuid])
    if state is ReservationState.RELEASING:
        await allocator.begin_release([uuid])
    return uuid


async def _call(
    allocator: Allocator, transition: Transition, uuids: list[GpuUuid]
) -> list[Reservation]:
    method: Callable[[list[GpuUuid]], Awaitable[list[Reservation]]] = getattr(
        allocator, transition.value
    )
    return await method(uuids)


class AllocatorContract:
    """The contract tests; subclass as ``Test...`` with an ``allocator_setup`` fixture."""

    async def test_reserve_is_all_or_nothing(self, allocator_setup: AllocatorSetup) -> None:
        setup = allocator_setup
        allocator = await _loaded(setup)
        first, second = setup.containers[:2]

        taken = await _reserve(allocator, setup, first, 3)

        assert len(taken) == 3 and len(_uuids(taken)) == 3
        assert all(entry.state is ReservationState.RESERVING for entry in taken)
        assert all(entry.container == first.key for entry in taken)
        assert all(entry.target == first.target for entry in taken)
        with pytest.raises(InsufficientGpus) as caught:
            await _reserve(allocator, setup, second, len(setup.candidates) - 2)
        assert (caught.value.free, caught.value.requested) == (
            len(setup.candidates) - 3,
            len(setup.candidates) - 2,
        )
        assert allocator.attachments_of(second.target) == []
        assert _uuids(allocator.all_attachments()) == _uuids(taken)

    async def test_available_is_what_no_reservation_holds(
        self, allocator_setup: AllocatorSetup
    ) -> None:
        # The one authority on "free" the attach decision reads (core/admission.py): a GPU
        # reserved, in any state, is not available; one released is again.
        setup = allocator_setup
        allocator = await _loaded(setup)
        assert await allocator.available(setup.candidates) == list(setup.candidates)

        taken = await _reserve(allocator, setup, setup.containers[0], 2)
        await allocator.mark_granted([taken[0].gpu.uuid])

        rest = [gpu for gpu in setup.candidates if gpu.uuid not in _uuids(taken)]
        assert await allocator.available(setup.candidates) == rest
        await allocator.release([entry.gpu.uuid for entry in taken])
        assert await allocator.available(setup.candidates) == list(setup.candidates)

    async def test_a_selectable_allocator_takes_exactly_its_candidates(
        self, allocator_setup: AllocatorSetup
    ) -> None:
        # What a request naming its GPUs rests on (the service passes only the named ones as
        # candidates); an allocator whose cluster picks the device says so instead, and the
        # service refuses such requests before it is asked.
        setup = allocator_setup
        allocator = await _loaded(setup)
        if not allocator.selectable:
            pytest.skip("the cluster picks the device: named GPUs are refused by the service")
        first, second = setup.containers[:2]
        named = setup.candidates[2]

        (entry,) = await allocator.reserve(
            first, 1, request_id=None, deadline=time.monotonic() + 60, candidates=[named]
        )
        assert entry.gpu == named and entry.container == first.key
        with pytest.raises(InsufficientGpus):
            await allocator.reserve(
                second, 1, request_id=None, deadline=time.monotonic() + 60, candidates=[named]
            )
        assert allocator.attachments_of(second.target) == []

    async def test_request_ids_are_recorded_not_interpreted(
        self, allocator_setup: AllocatorSetup
    ) -> None:
        # Whether an attach repeats an earlier one is the service's decision (made once, under
        # the target's lock): the allocator only keeps the id with each reservation.
        setup = allocator_setup
        allocator = await _loaded(setup)
        first, second = setup.containers[:2]

        mine = await _reserve(allocator, setup, first, 2, request_id="retry-1")
        theirs = await _reserve(allocator, setup, second, 1, request_id="retry-1")

        assert {entry.request_id for entry in mine + theirs} == {"retry-1"}
        assert not _uuids(theirs) & _uuids(mine)
        assert [e.request_id for e in allocator.attachments_of(first.target)] == ["retry-1"] * 2

    async def test_passed_deadline_reserves_nothing(self, allocator_setup: AllocatorSetup) -> None:
        setup = allocator_setup
        allocator = await _loaded(setup)

        with pytest.raises(Timeout):
            await allocator.reserve(
                setup.containers[0],
                1,
                request_id=None,
                deadline=time.monotonic() - 1,
                candidates=setup.candidates,
            )

        assert allocator.all_attachments() == []

    async def test_release_frees(self, allocator_setup: AllocatorSetup) -> None:
        setup = allocator_setup
        allocator = await _loaded(setup)
        first, second = setup.containers[:2]
        everything = await _reserve(allocator, setup, first, len(setup.candidates))

        await allocator.release([entry.gpu.uuid for entry in everything])
        await allocator.release([everything[0].gpu.uuid])  # repeating it changes nothing

        assert allocator.all_attachments() == []
        assert len(await _reserve(allocator, setup, second, len(setup.candidates))) == len(
            setup.candidates
        )

    @pytest.mark.parametrize(
        ("transition", "state"),
        list(TRANSITIONS),
        ids=[f"{t}-from-{s or 'nothing'}" for t, s in TRANSITIONS],
    )
    async def test_every_transition_follows_the_table(
        self,
        allocator_setup: AllocatorSetup,
        transition: Transition,
        state: ReservationState | None,
    ) -> None:
        setup = allocator_setup
        allocator = await _loaded(setup)
        uuid = await _in_state(allocator, setup, state)
        expected = TRANSITIONS[transition, state]

        if isinstance(expected, ReservationState):
            (entry,) = await _call(allocator, transition, [uuid])
            assert entry.state is expected
            assert (entry.granted_at is not None) == (expected is not ReservationState.RESERVING)
        else:
            with pytest.raises(expected):
                await _call(allocator, transition, [uuid])
            expected = state  # type: ignore[assignment]  # refused: nothing changed

        now = allocator.get(uuid)
        assert (None if now is None else now.state) is expected
        again = (await _loaded(setup)).get(uuid)
        assert (None if again is None else again.state) is _after_restart(setup, expected)

    @pytest.mark.parametrize(
        ("transition", "states", "error"),
        [
            (
                Transition.BEGIN_RELEASE,
                (ReservationState.GRANTED, ReservationState.RESERVING),
                Busy,
            ),
            (Transition.BEGIN_RELEASE, (ReservationState.GRANTED, None), NotFound),
            (
                Transition.MARK_GRANTED,
                (ReservationState.RESERVING, ReservationState.RELEASING),
                IllegalTransition,
            ),
            (
                Transition.CANCEL_RELEASE,
                (ReservationState.RELEASING, ReservationState.RESERVING),
                IllegalTransition,
            ),
        ],
        ids=["begin-release", "begin-release-unknown", "mark-granted", "cancel-release"],
    )
    async def test_a_refused_transition_changes_none_of_its_gpus(
        self,
        allocator_setup: AllocatorSetup,
        transition: Transition,
        states: tuple[ReservationState | None, ...],
        error: type[Exception],
    ) -> None:
        setup = allocator_setup
        allocator = await _loaded(setup)
        uuids = [
            await _in_state(allocator, setup, state, index=i) for i, state in enumerate(states)
        ]
        before = [allocator.get(uuid) for uuid in uuids]

        with pytest.raises(error):
            await _call(allocator, transition, uuids)

        assert [allocator.get(uuid) for uuid in uuids] == before
        restarted = await _loaded(setup)
        assert [None if e is None else e.state for e in map(restarted.get, uuids)] == [
            _after_restart(setup, state) for state in states
        ]

    async def test_transitions_keep_what_they_record(self, allocator_setup: AllocatorSetup) -> None:
        setup = allocator_setup
        allocator = await _loaded(setup)
        container = setup.containers[0]
        one, two = await _reserve(allocator, setup, container, 2)

        granted = await allocator.mark_granted(
            [one.gpu.uuid, two.gpu.uuid], nodes_created=[one.gpu.uuid]
        )
        assert [(e.state, e.node_created) for e in granted] == [
            (ReservationState.GRANTED, True),
            (ReservationState.GRANTED, False),
        ]
        assert await allocator.mark_granted([one.gpu.uuid]) == [granted[0]]  # unchanged
        await allocator.begin_release([one.gpu.uuid])
        (back,) = await allocator.cancel_release([one.gpu.uuid])
        # A cancelled release is the grant as it was: same time, same node record.
        assert (back.state, back.granted_at, back.node_created) == (
            ReservationState.GRANTED,
            granted[0].granted_at,
            True,
        )
        assert allocator.get(one.gpu.uuid) == back
        assert allocator.get(setup.candidates[-1].uuid) is None

    async def test_rebind_moves_the_reservation(self, allocator_setup: AllocatorSetup) -> None:
        setup = allocator_setup
        allocator = await _loaded(setup)
        old, new = setup.containers[:2]
        (entry,) = await _reserve(allocator, setup, old, 1)
        await allocator.mark_granted([entry.gpu.uuid])

        (moved,) = await allocator.rebind([entry.gpu.uuid], new)

        assert (moved.target, moved.container, moved.state) == (
            new.target,
            new.key,
            ReservationState.GRANTED,
        )
        assert allocator.attachments_of(old.target) == []
        assert allocator.attachments_of(new.target) == [moved]

    async def test_node_intent_is_recorded_before_the_grant(
        self, allocator_setup: AllocatorSetup
    ) -> None:
        """Intent on a reserving row survives a fresh instance (the agent killed after its
        ``mknod``), as ``RESERVING`` or, where the intent records the grant, ``GRANTED``; in
        memory the reservation stays ``RESERVING`` until ``mark_granted``, which records what
        the grant really did, durably."""
        setup = allocator_setup
        allocator = await _loaded(setup)
        (entry,) = await _reserve(allocator, setup, setup.containers[0], 1)
        uuid = entry.gpu.uuid
        await allocator.intend_grant([uuid], nodes_created=[uuid])
        assert allocator.get(uuid).state is ReservationState.RESERVING  # type: ignore[union-attr]
        restarted = await _loaded(setup)
        found = restarted.get(uuid)
        assert found is not None
        durable = (
            ReservationState.GRANTED if setup.finishes_intended else ReservationState.RESERVING
        )
        assert (found.state, found.node_created) == (durable, True)

        (other,) = await _reserve(restarted, setup, setup.containers[1], 1)
        await restarted.intend_grant([other.gpu.uuid], nodes_created=[other.gpu.uuid])
        (granted,) = await restarted.mark_granted([other.gpu.uuid], nodes_created=[])
        assert (granted.state, granted.node_created) == (ReservationState.GRANTED, False)
        await restarted.intend_grant([other.gpu.uuid], nodes_created=[other.gpu.uuid])
        assert restarted.get(other.gpu.uuid) == granted  # granted: the intent changes nothing
        assert (await _loaded(setup)).get(other.gpu.uuid) == granted

    async def test_every_state_survives_a_fresh_instance(
        self, allocator_setup: AllocatorSetup
    ) -> None:
        setup = allocator_setup
        allocator = await _loaded(setup)
        a, b, c = setup.containers[:3]
        (reserving,) = await _reserve(allocator, setup, a, 1)
        (granted,) = await _reserve(allocator, setup, b, 1, request_id="r-b")
        await allocator.mark_granted([granted.gpu.uuid], nodes_created=[granted.gpu.uuid])
        (releasing,) = await _reserve(allocator, setup, c, 1)
        await allocator.mark_granted([releasing.gpu.uuid])
        await allocator.begin_release([releasing.gpu.uuid])
        assert {e.state for e in allocator.all_attachments()} == set(ReservationState)
        before = [
            entry
            for entry in allocator.all_attachments()
            if _after_restart(setup, entry.state) is not None
        ]

        restarted = await _loaded(setup)

        assert restarted.all_attachments() == before
        assert restarted.get(granted.gpu.uuid) is not None
        assert restarted.get(granted.gpu.uuid).node_created  # type: ignore[union-attr]
        assert restarted.get(granted.gpu.uuid).request_id == "r-b"  # type: ignore[union-attr]
        assert (restarted.get(reserving.gpu.uuid) is None) is setup.finishes_intended

    async def test_concurrent_reservers_never_share_a_gpu(
        self, allocator_setup: AllocatorSetup
    ) -> None:
        setup = allocator_setup
        allocator = await _loaded(setup)
        contenders = setup.containers[: len(setup.candidates) + 1]

        async def one(container: HostContainer) -> list[Reservation]:
            try:
                return await _reserve(allocator, setup, container, 1)
            except InsufficientGpus:
                return []

        results = await asyncio.gather(*(one(c) for c in contenders))

        won = [entry.gpu.uuid for result in results for entry in result]
        assert len(won) == len(set(won)) == len(setup.candidates)
        assert len(allocator.all_attachments()) == len(setup.candidates)
