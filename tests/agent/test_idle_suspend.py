"""The idle policy's suspend (issue 39): a GPU its target holds but NVML sees unused — an idle
CUDA context, which every PyTorch kernel keeps — is idle too where the agent can keep the
kernel's state, and when it is due the whole target is suspended instead of left attached;
while another kernel's request waits, it is due after the shorter hand-over period.

Over the same fakes and clocks as ``test_idle.py``; the suspend itself is a double here (the
driver's part is ``test_e2e_suspend.py``'s): it lets the processes go and takes the GPUs back,
as a suspend's revoke does, or refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Final

import pytest

from jupyter_gpu_hotplug._structs import AttachmentList, GpuUuid, PidRef
from jupyter_gpu_hotplug.agent.core.errors import TargetNotReady
from jupyter_gpu_hotplug.agent.core.idle import IdleReason
from jupyter_gpu_hotplug.agent.core.idle_releaser import IdleReleaser
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest, HostContainer, Reservation
from jupyter_gpu_hotplug.agent.core.workers import Workers
from tests.fixtures.waiting import eventually

from .fakes import FakeProcess
from .service_harness import ADMIN, Harness
from .test_idle import Clocks, Idle


@dataclass
class Suspends:
    """The suspend the releaser is given: what it was asked, and whether it refuses."""

    harness: Harness
    asked: list[HostContainer] = field(default_factory=list)
    refuse: bool = False

    async def __call__(self, container: HostContainer) -> list[Reservation]:
        self.asked.append(container)
        if self.refuse:
            return []
        entries = self.harness.allocator.attachments_of(container.target)
        self.harness.injector.holders_of.clear()  # checkpointed: nothing holds the GPUs
        await self.harness.service.revoker.detach_locked(container, entries, force=False)
        return entries


@dataclass
class IdleWithSuspend(Idle):
    suspends: Suspends


@pytest.fixture
def idle(harness: Harness, workers: Workers) -> IdleWithSuspend:
    clocks = Clocks()
    usage: dict[GpuUuid, int | None] = {}
    suspends = Suspends(harness)
    releaser = IdleReleaser(
        harness.core,
        usage=lambda: dict(usage),
        release=harness.service.release_unused,
        suspend=suspends,
        clock=clocks.monotonic,
        wall=clocks.wall,
    )
    return IdleWithSuspend(harness, releaser, clocks, usage, suspends)


async def held_idle(idle: IdleWithSuspend, pid: int = 100) -> tuple[FakeProcess, GpuUuid]:
    """A kernel whose process holds its GPU (a CUDA context) while NVML sees it unused."""
    process, uuid = await idle.attach(pid)
    [entry] = idle.harness.allocator.attachments_of(process.target)
    idle.harness.injector.hold(process, entry.gpu.minor, pid=pid + 1, command="python")
    idle.usage[uuid] = 0
    return process, uuid


async def test_a_held_unused_gpu_is_announced_then_its_kernel_suspended(
    idle: IdleWithSuspend,
) -> None:
    idle.policy(idle_seconds=600, warning_seconds=60)
    process, uuid = await held_idle(idle)

    assert await idle.after(0) == []
    assert await idle.after(560) == []
    assert uuid in idle.harness.core.idle.warnings, "announced as any idle release is"
    assert await idle.after(40) == [uuid]

    assert [c.target for c in idle.suspends.asked] == [process.target]
    assert idle.attached(process) == []
    [release] = idle.harness.core.idle.releases_of(process.target)
    assert (release.uuid, release.reason) == (uuid, IdleReason.IDLE)
    assert idle.harness.sample("gpu_hotplug_idle_releases_total", reason="idle") == 1


@pytest.mark.parametrize("usage", [None, 30], ids=["nvml-cannot-say", "busy"])
async def test_a_held_gpu_nvml_does_not_see_unused_is_never_suspended(
    idle: IdleWithSuspend, usage: int | None
) -> None:
    idle.policy(idle_seconds=60, warning_seconds=10)
    process, uuid = await held_idle(idle)
    idle.usage[uuid] = usage

    for _ in range(5):
        assert await idle.after(3600) == []

    assert idle.suspends.asked == []
    assert idle.attached(process) == [uuid]


async def test_a_kernel_is_suspended_only_once_all_its_gpus_are_due(
    idle: IdleWithSuspend,
) -> None:
    """A suspend takes every GPU of the kernel: one still in use must not be stopped."""
    idle.policy(idle_seconds=100, warning_seconds=0)
    process = idle.harness.host.spawn(100, "kernel-100")
    answer = await idle.harness.service.attach(
        ADMIN, AttachRequest(count=2, target=PidRef(100), wait_seconds=60.0, request_id=None)
    )
    first, second = (a["uuid"] for a in answer["attachments"])
    for attachment in answer["attachments"]:
        idle.harness.injector.hold(process, attachment["minor"], pid=101)
    idle.usage.update({first: 0, second: 50})

    assert await idle.after(0) == []
    assert await idle.after(500) == [], "the second GPU works"
    assert idle.suspends.asked == []

    idle.usage[second] = 0
    assert await idle.after(50) == []
    assert sorted(await idle.after(50)) == sorted([first, second])
    assert len(idle.suspends.asked) == 1
    assert idle.attached(process) == []


async def test_a_refused_suspend_keeps_the_gpu_and_waits_a_whole_period_again(
    idle: IdleWithSuspend,
) -> None:
    idle.policy(idle_seconds=100, warning_seconds=0)
    process, uuid = await held_idle(idle)
    idle.suspends.refuse = True

    assert await idle.after(0) == []
    assert await idle.after(100) == []
    assert len(idle.suspends.asked) == 1
    assert idle.attached(process) == [uuid]

    assert await idle.after(99) == []
    assert len(idle.suspends.asked) == 1, "not asked again before another idle period"
    assert await idle.after(1) == []
    assert len(idle.suspends.asked) == 2


async def test_the_services_idle_suspend_is_refused_without_the_checkpoint_api(
    idle: IdleWithSuspend,
) -> None:
    """``AgentService.suspend_idle``, what the agent gives the releaser: a backend or driver
    that cannot keep state refuses, nothing changes, and nothing was released."""
    process, uuid = await held_idle(idle)
    container = idle.harness.resolver.resolve(PidRef(100))
    assert not idle.harness.service.suspender.available()

    with pytest.raises(TargetNotReady):
        await idle.harness.service.suspender.suspend(
            container, idle.harness.allocator.attachments_of(process.target)
        )
    assert await idle.harness.service.suspend_idle(container) == []
    assert idle.attached(process) == [uuid]


async def waits(idle: IdleWithSuspend, pid: int) -> asyncio.Task[AttachmentList]:
    """An attach of one GPU for kernel ``pid``, waiting in the queue (in the background)."""
    if pid not in idle.harness.host.processes:
        idle.harness.host.spawn(pid, f"kernel-{pid}")
    request = AttachRequest(1, PidRef(pid), wait_seconds=60.0, request_id=None, queued=True)
    task = asyncio.create_task(idle.harness.service.attach(ADMIN, request))
    await eventually(lambda: len(idle.harness.core.queue) == 1, f"{pid}'s request waits")
    return task


async def cancelled(task: asyncio.Task[AttachmentList]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


HANDOVER: Final = {"idle_seconds": 3600.0, "warning_seconds": 60.0, "handover_seconds": 300.0}
"""An idle period of an hour, a hand-over period of 300 s."""


async def handed_to(
    idle: IdleWithSuspend, waiting: asyncio.Task[AttachmentList], process: FakeProcess
) -> list[GpuUuid]:
    """``process``'s kernel was suspended (once); the GPUs ``waiting`` got."""
    assert [c.target for c in idle.suspends.asked] == [process.target]
    return [GpuUuid(a["uuid"]) for a in (await waiting)["attachments"]]


async def the_last_gpu_held_idle(
    idle: IdleWithSuspend, **policy: float
) -> tuple[FakeProcess, GpuUuid]:
    """The idle ``policy``; a kernel that keeps working (NVML: 100 %) holds every GPU but one,
    which kernel 100 holds idle (``held_idle``)."""
    idle.policy(**policy)
    hog = idle.harness.host.spawn(900, "hog")
    answer = await idle.harness.service.attach(
        ADMIN, AttachRequest(len(idle.harness.inventory.gpus) - 1, PidRef(900), 60.0, None)
    )
    for attachment in answer["attachments"]:
        idle.harness.injector.hold(hog, attachment["minor"], pid=901)
        idle.usage[attachment["uuid"]] = 100
    return await held_idle(idle)


async def test_a_waiting_request_has_an_idle_kernel_suspended_after_the_handover_period(
    idle: IdleWithSuspend,
) -> None:
    """Idle period an hour, hand-over 300 s: with nobody waiting the held-idle kernel keeps
    its GPU; once another kernel's request waits, it is announced and suspended when it has
    been idle for 300 s, and the waiting request gets its GPU."""
    process, uuid = await the_last_gpu_held_idle(idle, **HANDOVER)

    assert await idle.after(0) == []
    assert await idle.after(400) == [], "nobody waits: the whole idle period applies"
    assert uuid not in idle.harness.core.idle.warnings

    waiting = await waits(idle, 200)
    assert await idle.after(0) == [uuid], "idle for 400 s already: handed over at once"

    assert await handed_to(idle, waiting, process) == [uuid]
    [release] = idle.harness.core.idle.releases_of(process.target)
    assert release.reason is IdleReason.IDLE


async def announced(
    idle: IdleWithSuspend,
) -> tuple[FakeProcess, GpuUuid, asyncio.Task[AttachmentList]]:
    """Kernel 100 holds the last GPU idle, kernel 200's request waits: after 240 s of
    idleness its hand-over is announced (60 s ahead). The kernel, its GPU, the waiting
    request."""
    process, uuid = await the_last_gpu_held_idle(idle, **HANDOVER)
    assert await idle.after(0) == []
    waiting = await waits(idle, 200)
    assert await idle.after(230) == []
    assert uuid not in idle.harness.core.idle.warnings
    assert await idle.after(10) == []
    assert uuid in idle.harness.core.idle.warnings, "announced 60 s before"
    return process, uuid, waiting


async def test_the_handover_is_announced_and_counts_from_the_start_of_idleness(
    idle: IdleWithSuspend,
) -> None:
    process, uuid, waiting = await announced(idle)
    assert await idle.after(59) == []
    assert await idle.after(1) == [uuid]
    assert await handed_to(idle, waiting, process) == [uuid]


@pytest.mark.parametrize(
    ("policy", "waiter", "idle_for"),
    [
        # The same kernel asks for a second GPU: its own request never suspends it.
        (HANDOVER, 100, 1000),
        ({"idle_seconds": 3600.0, "warning_seconds": 60.0}, 200, 3000),
    ],
    ids=["its-own-request", "no-handover-period"],
)
async def test_a_waiting_request_that_may_not_hand_over_changes_nothing(
    idle: IdleWithSuspend, policy: dict[str, float], waiter: int, idle_for: float
) -> None:
    process, uuid = await the_last_gpu_held_idle(idle, **policy)
    waiting = await waits(idle, waiter)

    assert await idle.after(0) == []
    assert await idle.after(idle_for) == []
    assert idle.suspends.asked == []
    assert idle.attached(process) == [uuid]
    await cancelled(waiting)


async def test_a_handover_announced_for_a_request_that_stops_waiting_is_called_off(
    idle: IdleWithSuspend,
) -> None:
    process, uuid, waiting = await announced(idle)

    await cancelled(waiting)
    await eventually(lambda: len(idle.harness.core.queue) == 0, "nobody waits")
    assert await idle.after(10) == []
    assert uuid not in idle.harness.core.idle.warnings, "no longer due in 40 s"
    assert await idle.after(100) == []
    assert idle.suspends.asked == []
    assert idle.attached(process) == [uuid]
