"""The orchestration of attach and detach, against in-memory host fakes and a real ledger.

What must hold whatever happens: a GPU is usable by a target only with a ledger entry, never by
two targets, and never lost from the pool; failures roll back; one operation per target at a
time; retries with a ``request_id`` do not attach twice.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PidRef, PidTarget, PodTarget, RequestId, Target
from jupyter_gpu_hotplug.agent.core.checkpoints import Checkpoints, marker_path
from jupyter_gpu_hotplug.agent.core.errors import (
    Busy,
    Forbidden,
    InsufficientGpus,
    InvalidRequest,
    LookupFailed,
    NotFound,
    TargetNotReady,
    Unavailable,
)
from jupyter_gpu_hotplug.agent.core.injector import InjectionFailed, ScanUnfinished, TargetGone
from jupyter_gpu_hotplug.agent.core.seams import (
    AttachRequest,
    ContainerCgroups,
    GpuLimit,
    HostContainer,
    ReservationState,
)
from jupyter_gpu_hotplug.agent.core.workers import Workers
from jupyter_gpu_hotplug.linux.devrules import CharDevice
from tests.fixtures.waiting import eventually

from .fakes import Gate, clean_failure, unclean_failure
from .service_harness import ADMIN, Harness, build


def request(count: int = 1, pid: int | None = None, request_id: str | None = None) -> AttachRequest:
    return AttachRequest(
        count=count,
        target=None if pid is None else PidRef(pid),
        wait_seconds=60.0,
        request_id=None if request_id is None else RequestId(request_id),
    )


def gpu(minor: int) -> CharDevice:
    return CharDevice(195, minor)


async def test_attach_grants_records_and_answers(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")

    result = await harness.service.attach(ADMIN, request(2, pid=100))

    assert [a["minor"] for a in result["attachments"]] == [0, 1]
    assert all(a["target"] == {"pid": 100} and a["holder"] is None for a in result["attachments"])
    assert result["attachments"][0]["device"] == "/dev/nvidia0"
    assert harness.injector.usable(kernel.target) == {gpu(0), gpu(1)}
    entries = harness.ledger.attachments(kernel.target)
    assert [(e.gpu.minor, e.state) for e in entries] == [
        (0, ReservationState.GRANTED),
        (1, ReservationState.GRANTED),
    ]
    assert harness.sample("gpu_hotplug_attach_total", result="success") == 1
    assert harness.sample("gpu_hotplug_operations_in_flight") == 0


async def test_insufficient_gpus_changes_nothing(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    await harness.service.attach(ADMIN, request(3, pid=100))
    other = harness.host.spawn(200, "kernel-b")

    with pytest.raises(InsufficientGpus) as caught:
        await harness.service.attach(ADMIN, request(2, pid=200))

    assert (caught.value.free, caught.value.requested) == (1, 2)
    assert harness.injector.usable(other.target) == set()
    assert len(harness.ledger.attachments(kernel.target)) == 3
    assert harness.ledger.attachments(other.target) == []
    assert harness.sample("gpu_hotplug_attach_total", result="insufficient_gpus") == 1


async def test_count_above_the_node_can_never_be_served(harness: Harness) -> None:
    # A well-formed request the node cannot serve however long it waits: 409, not retryable
    # (the document calls any positive count valid; the node's size is known only here).
    harness.host.spawn(100, "kernel-a")

    with pytest.raises(InsufficientGpus) as caught:
        await harness.service.attach(ADMIN, request(5, pid=100))

    assert (caught.value.free, caught.value.requested, caught.value.retryable) == (4, 5, False)
    assert "more than this node's 4 GPU(s)" in caught.value.message


async def test_per_target_limit(tmp_path: Path, workers: Workers) -> None:
    harness = await build(tmp_path, max_gpus=2, workers=workers)
    try:
        harness.host.spawn(100, "kernel-a")
        await harness.service.attach(ADMIN, request(1, pid=100))

        with pytest.raises(Forbidden) as caught:
            await harness.service.attach(ADMIN, request(2, pid=100))

        assert caught.value.extra == {"limit": 2, "attached": 1, "requested": 2}
    finally:
        harness.ledger.close()


async def test_gpu_limit_counts_the_container_not_the_pid(tmp_path: Path, workers: Workers) -> None:
    """Attack (issue 25, item 10): with a limit of 1, a container got a second GPU by naming its
    second process as the target. The limit is the container's, whichever process is named."""
    harness = await build(tmp_path, max_gpus=1, workers=workers)
    try:
        harness.host.spawn(100, "kernel-a")
        harness.host.spawn(101, "kernel-a")  # another process of the same container
        await harness.service.attach(ADMIN, request(1, pid=100))

        with pytest.raises(Forbidden) as caught:
            await harness.service.attach(ADMIN, request(1, pid=101))

        assert caught.value.extra == {"limit": 1, "attached": 1, "requested": 1}
        assert len(harness.ledger.attachments()) == 1
    finally:
        harness.ledger.close()


class GroupPolicy:
    """A backend's ``TargetPolicy`` stand-in: processes 100 and 200 form one group of
    ``limit`` GPUs; process 300 may have none, nor anyone once ``closed``."""

    def __init__(self, limit: int, *, closed: bool = False) -> None:
        self.limit = limit
        self.closed = closed

    async def gpu_limit(self, container: HostContainer) -> GpuLimit:
        if _pid(container.target) == 300 or self.closed:
            raise Forbidden(f"{container} may not get GPUs here")
        return GpuLimit(
            count=self.limit,
            source="the test's group limit",
            covers=lambda target: _pid(target) in (100, 200),
        )


def _pid(target: Target) -> int | None:
    return target.pid if isinstance(target, PidTarget) else None


async def test_the_backends_policy_limits_a_group_of_containers_together(
    harness: Harness,
) -> None:
    """Kubernetes counts a pod's containers together (``kubernetes/tenancy.py``): the limit
    the policy gives covers every target of the group, each container's own limit still
    applies, and a refusal names where the limit comes from."""
    harness.core.policy = GroupPolicy(limit=2)
    for pid, name in ((100, "kernel-a"), (200, "kernel-b"), (300, "kernel-c")):
        harness.host.spawn(pid, name)
    await harness.service.attach(ADMIN, request(1, pid=100))
    await harness.service.attach(ADMIN, request(1, pid=200))

    with pytest.raises(Forbidden) as caught:
        await harness.service.attach(ADMIN, request(1, pid=100))

    assert caught.value.extra == {"limit": 2, "attached": 2, "requested": 1}
    assert "the test's group limit" in caught.value.message
    with pytest.raises(Forbidden, match="may not get GPUs here"):
        await harness.service.attach(ADMIN, request(1, pid=300))
    assert len(harness.ledger.attachments()) == 2


async def test_a_retried_attach_is_answered_as_first_whatever_the_policy_says_now(
    harness: Harness,
) -> None:
    """A retry with the same request id repeats the first answer: the policy is asked only
    for what would be new (a namespace unlisted meanwhile stops new attaches, not retries)."""
    harness.host.spawn(100, "kernel-a")
    harness.core.policy = GroupPolicy(limit=1)
    first = await harness.service.attach(ADMIN, request(1, pid=100, request_id="r1"))

    harness.core.policy = GroupPolicy(limit=1, closed=True)

    assert await harness.service.attach(ADMIN, request(1, pid=100, request_id="r1")) == first
    with pytest.raises(Forbidden, match="may not get GPUs here"):
        await harness.service.attach(ADMIN, request(1, pid=100, request_id="r2"))


@pytest.mark.parametrize("failure", [clean_failure, unclean_failure], ids=["clean", "unclean"])
async def test_failed_grant_rolls_back(harness: Harness, failure: type[Exception]) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    harness.injector.grant_error = failure
    harness.injector.partial = True

    with pytest.raises(TargetNotReady) as caught:
        await harness.service.attach(ADMIN, request(1, pid=100))

    assert not caught.value.retryable
    assert harness.ledger.attachments() == []
    # An unclean failure is revoked by the service; a clean one needs nothing from it.
    expected_calls = ["grant", "revoke"] if failure is unclean_failure else ["grant"]
    assert [call[0] for call in harness.injector.calls] == expected_calls
    if failure is unclean_failure:
        assert harness.injector.usable(kernel.target) == set()


async def test_unrevocable_grant_stays_reserved_for_the_reconciler(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    harness.injector.grant_error = unclean_failure
    harness.injector.partial = True
    harness.injector.revoke_error = unclean_failure

    with pytest.raises(TargetNotReady):
        await harness.service.attach(ADMIN, request(1, pid=100))

    # The GPU may still be usable: the ledger must keep saying whose it is.
    (entry,) = harness.ledger.attachments(kernel.target)
    assert entry.state is ReservationState.RESERVING
    assert harness.injector.usable(kernel.target) == {gpu(0)}

    harness.injector.revoke_error = None
    report = await harness.reconciler.run_once()

    assert report.actions == {"rolled_back_attach": [entry.gpu.uuid]}
    assert harness.ledger.attachments() == []
    assert harness.injector.usable(kernel.target) == set()


async def test_target_exiting_during_grant_is_not_found(harness: Harness) -> None:
    harness.host.spawn(100, "kernel-a")

    def exits() -> Exception:
        return TargetGone("process 100 has exited")

    harness.injector.grant_error = exits

    with pytest.raises(NotFound) as caught:
        await harness.service.attach(ADMIN, request(1, pid=100))

    assert caught.value.name == "100"
    assert harness.ledger.attachments() == []


async def test_request_id_makes_a_retry_idempotent(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")

    first = await harness.service.attach(ADMIN, request(2, pid=100, request_id="retry-1"))
    again = await harness.service.attach(ADMIN, request(2, pid=100, request_id="retry-1"))

    assert again == first
    assert [call[0] for call in harness.injector.calls] == ["grant"]
    assert len(harness.ledger.attachments(kernel.target)) == 2

    with pytest.raises(InvalidRequest) as caught:
        await harness.service.attach(ADMIN, request(1, pid=100, request_id="retry-1"))
    assert caught.value.field == "request_id"


async def test_one_operation_per_target_at_a_time(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    harness.injector.gate = gate = Gate()
    first = asyncio.create_task(harness.service.attach(ADMIN, request(1, pid=100)))
    await asyncio.to_thread(gate.wait_for, 1)

    with pytest.raises(Busy) as caught:
        await harness.service.attach(ADMIN, request(1, pid=100))

    assert caught.value.retryable
    assert harness.sample("gpu_hotplug_operations_in_flight") == 1
    gate.open()
    await first
    assert len(harness.ledger.attachments(kernel.target)) == 1


async def test_different_targets_run_in_parallel(harness: Harness) -> None:
    for pid in (100, 200, 300):
        harness.host.spawn(pid, f"kernel-{pid}")
    harness.injector.gate = gate = Gate()
    tasks = [
        asyncio.create_task(harness.service.attach(ADMIN, request(1, pid=pid)))
        for pid in (100, 200, 300)
    ]

    # All three grants are under way at the same moment: none waits for another.
    await asyncio.to_thread(gate.wait_for, 3)
    gate.open()
    results = await asyncio.gather(*tasks)

    minors = sorted(r["attachments"][0]["minor"] for r in results)
    assert minors == [0, 1, 2]


async def test_concurrent_requests_never_share_a_gpu(harness: Harness) -> None:
    for pid in range(100, 108):
        harness.host.spawn(pid, f"kernel-{pid}")

    outcomes = await asyncio.gather(
        *(harness.service.attach(ADMIN, request(1, pid=pid)) for pid in range(100, 108)),
        return_exceptions=True,
    )

    granted = [o for o in outcomes if isinstance(o, dict)]
    refused = [o for o in outcomes if isinstance(o, InsufficientGpus)]
    assert (len(granted), len(refused)) == (4, 4)
    owners: dict[CharDevice, list[str]] = {}
    for where, devices in harness.injector.granted.items():
        for device in devices:
            owners.setdefault(device, []).append(str(where))
    assert sorted(owners) == [gpu(m) for m in range(4)]
    assert all(len(holders) == 1 for holders in owners.values())


async def test_caller_itself_is_its_containers_oldest_process(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    terminal = harness.host.spawn(150, "kernel-a")

    result = await harness.service.attach(await harness.peer(terminal.pid), request(1))

    assert result["attachments"][0]["target"] == {"pid": kernel.pid}
    listed = await harness.service.attachments(await harness.peer(terminal.pid), None)
    assert listed == result


async def test_peer_may_act_on_its_own_container_only(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    harness.host.spawn(150, "kernel-a")
    harness.host.spawn(200, "kernel-b")

    await harness.service.attach(await harness.peer(150), request(1, pid=100))
    with pytest.raises(Forbidden):
        await harness.service.attach(await harness.peer(150), request(1, pid=200))
    with pytest.raises(Forbidden):
        await harness.service.attachments(await harness.peer(150), PidRef(200))
    with pytest.raises(Forbidden):  # nor may another container take them all away
        await harness.service.detach_all(await harness.peer(200), PidRef(100), force=False)

    assert [e.target for e in harness.ledger.attachments()] == [kernel.target]


async def test_tcp_caller_must_name_a_target(harness: Harness) -> None:
    # "The caller itself" over TCP is no container: well formed, and not found.
    with pytest.raises(NotFound, match="name the target") as caught:
        await harness.service.attach(ADMIN, request(1))

    assert caught.value.resource == "container of the caller"


async def test_pod_targets_need_the_kubernetes_backend(harness: Harness) -> None:
    pod = AttachRequest(count=1, target=PodTarget("ns", "pod"), wait_seconds=60.0, request_id=None)

    with pytest.raises(NotFound) as caught:
        await harness.service.attach(ADMIN, pod)

    assert (caught.value.resource, caught.value.name) == ("pod", "ns/pod")
    assert "local backend" in caught.value.message


async def test_refused_targets(harness: Harness) -> None:
    harness.host.spawn(301, ContainerCgroups(devices_v1="/", unified="/"))

    with pytest.raises(Forbidden, match="agent itself"):
        await harness.service.attach(ADMIN, request(1, pid=harness.resolver.agent_pid))
    with pytest.raises(Forbidden, match="not in a container"):
        await harness.service.attach(ADMIN, request(1, pid=301))
    with pytest.raises(NotFound):
        await harness.service.attach(ADMIN, request(1, pid=999))


async def test_detach_revokes_and_releases(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    result = await harness.service.attach(ADMIN, request(2, pid=100))
    first = result["attachments"][0]["uuid"]

    await harness.service.detach(ADMIN, first, force=False)

    assert harness.injector.usable(kernel.target) == {gpu(1)}
    assert [e.gpu.minor for e in harness.ledger.attachments()] == [1]
    assert harness.sample("gpu_hotplug_detach_total", result="success") == 1
    with pytest.raises(NotFound):
        await harness.service.detach(ADMIN, first, force=False)


async def test_a_detach_while_the_target_cannot_be_looked_up_is_refused_and_keeps_all(
    harness: Harness,
) -> None:
    """The runtime or the API server does not answer: the target is not known to be gone, so
    the GPU is not released as an exited target's would be (its grant would outlive the
    reservation); 422, worth retrying, with everything as it was."""
    kernel = harness.host.spawn(100, "kernel-a")
    result = await harness.service.attach(ADMIN, request(1, pid=100))
    uuid = GpuUuid(result["attachments"][0]["uuid"])
    harness.resolver.unanswered = True

    with pytest.raises(LookupFailed) as refused:
        await harness.service.detach(ADMIN, uuid, force=False)

    assert (refused.value.status, refused.value.retryable) == (422, True)
    assert [e.gpu.uuid for e in harness.ledger.attachments()] == [uuid]
    assert harness.injector.usable(kernel.target) == {gpu(0)}
    harness.resolver.unanswered = False
    await harness.service.detach(ADMIN, uuid, force=False)
    assert harness.ledger.attachments() == []


async def test_busy_detach_refused_then_forced(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    result = await harness.service.attach(ADMIN, request(1, pid=100))
    uuid = result["attachments"][0]["uuid"]
    harness.injector.hold(kernel, 0, pid=101, command="python3")

    with pytest.raises(Busy) as caught:
        await harness.service.detach(ADMIN, uuid, force=False)

    assert caught.value.processes == ({"pid": 101, "command": "python3"},)
    assert not caught.value.retryable
    (entry,) = harness.ledger.attachments()
    assert entry.state is ReservationState.GRANTED
    assert harness.injector.usable(kernel.target) == {gpu(0)}

    await harness.service.detach(ADMIN, uuid, force=True)

    assert harness.ledger.attachments() == []
    assert [h.pid for h in harness.injector.forced] == [101]


async def test_a_busy_scan_past_its_deadline_is_503_and_changes_nothing(harness: Harness) -> None:
    """Issue 25: the scan of a huge container took 25-45 s. Past its deadline the detach is
    answered 503 with retry_after (and the GPU stays attached, as it was)."""
    harness.host.spawn(100, "kernel-a")
    await harness.service.attach(ADMIN, request(1, pid=100))
    harness.injector.revoke_error = lambda: ScanUnfinished(
        "the scan looked at 3 of 500 processes before its deadline", seconds=14.5
    )

    with pytest.raises(Unavailable) as caught:
        await harness.service.detach_all(ADMIN, PidRef(100), force=False)

    assert (caught.value.status, caught.value.code, caught.value.retry_after) == (503, "busy", 15)
    assert caught.value.to_body()["retry_after"] == 15
    assert "3 of 500 processes" in caught.value.message
    [entry] = harness.ledger.attachments()
    assert entry.state is ReservationState.GRANTED
    assert harness.injector.usable(harness.host.processes[100].target) == {gpu(0)}


async def test_failed_revoke_keeps_the_attachment(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    result = await harness.service.attach(ADMIN, request(1, pid=100))
    harness.injector.revoke_error = clean_failure

    with pytest.raises(TargetNotReady):
        await harness.service.detach(ADMIN, result["attachments"][0]["uuid"], force=False)

    (entry,) = harness.ledger.attachments()
    assert entry.state is ReservationState.GRANTED
    assert harness.injector.usable(kernel.target) == {gpu(0)}


async def test_unclean_revoke_is_left_releasing_for_the_reconciler(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    result = await harness.service.attach(ADMIN, request(1, pid=100))
    harness.injector.revoke_error = unclean_failure

    with pytest.raises(TargetNotReady) as caught:
        await harness.service.detach(ADMIN, result["attachments"][0]["uuid"], force=False)

    assert caught.value.retryable
    (entry,) = harness.ledger.attachments()
    assert entry.state is ReservationState.RELEASING
    harness.injector.revoke_error = None
    await harness.reconciler.run_once()
    assert harness.ledger.attachments() == []
    assert harness.injector.usable(kernel.target) == set()


async def test_detach_all(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    await harness.service.attach(ADMIN, request(3, pid=100))

    await harness.service.detach_all(await harness.peer(100), None, force=False)

    assert harness.ledger.attachments() == []
    assert harness.injector.usable(kernel.target) == set()
    assert harness.sample("gpu_hotplug_detach_total", result="success") == 3
    # Nothing attached: nothing to do, and no error.
    await harness.service.detach_all(ADMIN, PidRef(100), force=False)


async def test_detach_of_an_exited_target_releases_for_token_holders_only(
    harness: Harness,
) -> None:
    harness.host.spawn(100, "kernel-a")
    harness.host.spawn(150, "kernel-a")
    result = await harness.service.attach(ADMIN, request(1, pid=100))
    uuid = GpuUuid(result["attachments"][0]["uuid"])
    caller = await harness.peer(150)
    harness.host.remove_container("kernel-a")

    with pytest.raises(Forbidden):
        await harness.service.detach(caller, uuid, force=False)
    await harness.service.detach(ADMIN, uuid, force=False)

    assert harness.ledger.attachments() == []


async def test_the_gpu_list_names_only_the_targets_the_caller_may_see(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31: ``/v1/gpus`` named other tenants' pods. The identity says whom a caller may
    see (``may_see``); any other target's GPU is listed taken, by nobody named."""
    for pid, name in ((100, "kernel-a"), (200, "kernel-b")):
        harness.host.spawn(pid, name)
        await harness.service.attach(ADMIN, request(1, pid=pid))

    async def only_100(caller: object, target: Target) -> bool:
        return _pid(target) == 100

    monkeypatch.setattr(harness.identity, "may_see", only_100)
    listed = (await harness.service.gpus(ADMIN))["gpus"]

    assert [(g["state"], g["target"]) for g in listed] == [
        ("attached", {"pid": 100}),
        ("attached", None),
        ("free", None),
        ("free", None),
    ]


async def test_gpu_views_and_lost_gpus(harness: Harness) -> None:
    harness.host.spawn(100, "kernel-a")
    await harness.service.attach(ADMIN, request(1, pid=100))
    harness.inventory.lose(3)

    listed = (await harness.service.gpus(ADMIN))["gpus"]

    assert [(g["minor"], g["state"], g["target"]) for g in listed] == [
        (0, "attached", {"pid": 100}),
        (1, "free", None),
        (2, "free", None),
    ]
    assert all(g["simulated"] for g in listed)
    assert harness.sample("gpu_hotplug_gpus", state="lost") == 1
    assert harness.sample("gpu_hotplug_gpus", state="attached") == 1
    assert harness.sample("gpu_hotplug_gpus", state="free") == 2
    # A lost GPU is never handed out.
    harness.host.spawn(200, "kernel-b")
    result = await harness.service.attach(ADMIN, request(2, pid=200))
    assert [a["minor"] for a in result["attachments"]] == [1, 2]


async def test_pause_hook_stops_an_attach_at_its_step(tmp_path: Path, workers: Workers) -> None:
    harness = await build(
        tmp_path,
        checkpoints=Checkpoints(pause_at="after_grant", marker_dir=tmp_path),
        workers=workers,
    )
    try:
        kernel = harness.host.spawn(100, "kernel-a")
        attach = asyncio.create_task(harness.service.attach(ADMIN, request(1, pid=100)))
        await eventually(marker_path(tmp_path, "after_grant").exists, "the attach pauses")
        assert not attach.done()

        (entry,) = harness.ledger.attachments()
        assert entry.state is ReservationState.RESERVING
        assert harness.injector.usable(kernel.target) == {gpu(0)}
        attach.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attach
    finally:
        harness.ledger.close()


def test_injection_failed_carries_cleanliness() -> None:
    assert InjectionFailed("x", clean=True).clean
    assert not InjectionFailed("x", clean=False).clean
