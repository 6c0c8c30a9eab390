"""The fair wait queue, through the service, against in-memory host fakes and a real ledger.

What must hold: requests that wait are served first come, first served; each can see its
position; a freed GPU goes to the first waiter; a request that fits is served while the first
cannot be, but only ``QUEUE_OVERTAKES`` times, then what is freed is held for the first; one
container may have only ``MAX_WAITERS_PER_CONTAINER`` waiting; a cancelled waiter, one whose
deadline passes and one whose target exits leave the queue with nothing reserved for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from jupyter_gpu_hotplug._structs import (
    MAX_WAITERS_PER_CONTAINER,
    QUEUE_OVERTAKES,
    AttachmentList,
    GpuUuid,
    PidRef,
    RequestId,
)
from jupyter_gpu_hotplug.agent.core.errors import (
    Busy,
    Forbidden,
    InsufficientGpus,
    NotFound,
    Timeout,
)
from jupyter_gpu_hotplug.agent.core.queue import WaitQueue
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest
from jupyter_gpu_hotplug.agent.core.service import AgentService
from tests.fixtures.waiting import eventually

from .service_harness import ADMIN, Harness


def waiting(
    pid: int, *, count: int = 1, wait: float = 60.0, request_id: str | None = None
) -> AttachRequest:
    return AttachRequest(
        count=count,
        target=PidRef(pid),
        wait_seconds=wait,
        request_id=None if request_id is None else RequestId(request_id),
        queued=True,
    )


class Queue:
    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.tasks: list[asyncio.Task[AttachmentList]] = []

    @property
    def service(self) -> AgentService:
        return self.harness.service

    def ask(
        self, pid: int, *, count: int = 1, wait: float = 60.0, request_id: str | None = None
    ) -> asyncio.Task[AttachmentList]:
        """Start an attach for a new kernel ``pid`` that waits (in the background)."""
        self.harness.host.spawn(pid, f"kernel-{pid}")
        request = waiting(pid, count=count, wait=wait, request_id=request_id)
        task = asyncio.create_task(self.service.attach(ADMIN, request))
        self.tasks.append(task)
        return task

    async def at_once(self, pid: int) -> AttachmentList:
        """An attach of one GPU for a new kernel ``pid`` that does not wait."""
        self.harness.host.spawn(pid, f"kernel-{pid}")
        request = AttachRequest(count=1, target=PidRef(pid), wait_seconds=60, request_id=None)
        return await self.service.attach(ADMIN, request)

    async def refused_at_once(self, pid: int) -> InsufficientGpus:
        with pytest.raises(InsufficientGpus) as refused:
            await self.at_once(pid)
        return refused.value

    async def free_gpus(self) -> int:
        """What ``GET /v1/gpus`` says is free."""
        return sum(1 for gpu in (await self.service.gpus(ADMIN))["gpus"] if gpu["state"] == "free")

    async def positions(self, pid: int) -> list[int]:
        view = await self.service.queued(ADMIN, PidRef(pid))
        return [request["position"] for request in view["requests"]]

    async def until_waiting(self, count: int) -> None:
        await eventually(lambda: len(self.harness.core.queue) == count, f"{count} request(s) wait")

    def held_by(self, pid: int) -> list[GpuUuid]:
        target = self.harness.host.processes[pid].target
        return [entry.gpu.uuid for entry in self.harness.allocator.attachments_of(target)]


@pytest.fixture
async def queue(harness: Harness) -> AsyncIterator[Queue]:
    # Look again every 50 ms by itself (a target that exited is noticed then).
    harness.core.queue = WaitQueue(recheck=0.05, on_change=harness.metrics.queue_length.set)
    helper = Queue(harness)
    # Three of the four GPUs are held by someone who stays: one is free.
    harness.host.spawn(900, "hog")
    await harness.service.attach(
        ADMIN, AttachRequest(count=3, target=PidRef(900), wait_seconds=60, request_id=None)
    )
    yield helper
    for task in helper.tasks:
        task.cancel()
    await asyncio.gather(*helper.tasks, return_exceptions=True)


async def test_three_kernels_one_gpu_first_come_first_served(queue: Queue) -> None:
    first = queue.ask(100)
    served = await first
    assert [a["target"] for a in served["attachments"]] == [{"pid": 100}]

    second = queue.ask(200)
    await queue.until_waiting(1)
    third = queue.ask(300)
    await queue.until_waiting(2)

    assert await queue.positions(200) == [1]
    assert await queue.positions(300) == [2]
    assert (await queue.service.queued(ADMIN, PidRef(300)))["length"] == 2
    assert queue.harness.sample("gpu_hotplug_queue_length") == 2
    assert not second.done() and not third.done()

    await queue.service.detach(ADMIN, served["attachments"][0]["uuid"], force=False)
    got = await second

    assert [a["target"] for a in got["attachments"]] == [{"pid": 200}]
    assert not third.done()
    assert await queue.positions(300) == [1]
    assert queue.held_by(100) == []

    (pending,) = (await queue.service.queued(ADMIN, PidRef(300)))["requests"]
    await queue.service.cancel_queued(ADMIN, RequestId(pending["request_id"]), PidRef(300))
    with pytest.raises(InsufficientGpus, match="GPU") as cancelled:
        await third
    assert "cancelled while it waited" in cancelled.value.message
    assert len(queue.harness.core.queue) == 0
    assert queue.held_by(300) == []
    assert queue.harness.sample("gpu_hotplug_queue_length") == 0


async def test_deadline_answers_504_and_leaves_nothing(queue: Queue) -> None:
    await queue.ask(100)  # takes the free GPU
    before = queue.harness.ledger.attachments()

    with pytest.raises(Timeout, match=r"within 0\.2 s"):
        await queue.ask(200, wait=0.2)

    assert len(queue.harness.core.queue) == 0
    assert queue.harness.ledger.attachments() == before
    assert queue.held_by(200) == []


async def test_a_request_that_fits_is_served_while_the_head_cannot_be(queue: Queue) -> None:
    """Attack (issue 25, item 7): one container's waiter for 2 GPUs (1 free) made every other
    caller get 409 "0 free" while ``/v1/gpus`` showed one free. A request that fits is served
    when the head of the queue cannot be; what the 409 says free is what ``/v1/gpus`` says."""
    big = queue.ask(100, count=2)  # one is free: it waits
    await queue.until_waiting(1)

    served = await queue.at_once(200)
    assert [a["target"] for a in served["attachments"]] == [{"pid": 200}]
    assert not big.done()

    refused = await queue.refused_at_once(300)
    assert refused.free == await queue.free_gpus() == 0


async def test_the_head_is_not_starved_by_requests_that_fit(queue: Queue) -> None:
    """Overtaking is bounded: once the head has been overtaken ``QUEUE_OVERTAKES`` times, what
    is freed is held for it, and the 409 of a request that would take it says so — with the
    same free count as ``/v1/gpus``."""
    big = queue.ask(100, count=2)
    await queue.until_waiting(1)
    hog = queue.held_by(900)
    for pid in range(200, 200 + QUEUE_OVERTAKES):
        got = await queue.at_once(pid)
        await queue.service.detach(ADMIN, got["attachments"][0]["uuid"], force=False)
    assert not big.done()

    refused = await queue.refused_at_once(300)
    assert refused.free == await queue.free_gpus() == 1
    assert "held for the request first in the queue" in refused.message
    small = queue.ask(400)  # a waiter that fits does not overtake a held head either
    await queue.until_waiting(2)

    await queue.service.detach(ADMIN, hog[0], force=False)

    assert len((await big)["attachments"]) == 2
    assert not small.done()


async def test_one_container_may_not_fill_the_queue(queue: Queue) -> None:
    """Attack (issue 25, item 7): one container queued 20 waiters. It may have
    ``MAX_WAITERS_PER_CONTAINER``; the next is refused at once and nothing is queued for it."""
    await queue.ask(100)  # takes the free GPU
    for pid in range(200, 200 + MAX_WAITERS_PER_CONTAINER):
        queue.harness.host.spawn(pid, "greedy")
        task = asyncio.create_task(queue.service.attach(ADMIN, waiting(pid)))
        queue.tasks.append(task)
    await queue.until_waiting(MAX_WAITERS_PER_CONTAINER)

    queue.harness.host.spawn(299, "greedy")
    with pytest.raises(Busy, match="already waits") as refused:
        await queue.service.attach(ADMIN, waiting(299))
    assert refused.value.retryable
    assert len(queue.harness.core.queue) == MAX_WAITERS_PER_CONTAINER
    queue.ask(300)  # another container still queues
    await queue.until_waiting(MAX_WAITERS_PER_CONTAINER + 1)


async def test_cancel_is_scoped_to_the_callers_target(queue: Queue) -> None:
    """Attack (issue 25, item 9): a token holder's cancel of a request id cancelled every
    waiter with that id, any container's. It cancels the named target's only."""
    await queue.ask(100)  # takes the free GPU
    mine = queue.ask(200, request_id="same-id")
    theirs = queue.ask(300, request_id="same-id")
    await queue.until_waiting(2)

    await queue.service.cancel_queued(ADMIN, RequestId("same-id"), PidRef(200))

    with pytest.raises(InsufficientGpus, match="cancelled"):
        await mine
    assert not theirs.done()
    assert await queue.positions(300) == [1]
    with pytest.raises(NotFound, match="queued request"):
        await queue.service.cancel_queued(ADMIN, RequestId("same-id"), PidRef(200))


async def test_freed_by_the_reconciler_wakes_the_first_waiter(queue: Queue) -> None:
    await queue.ask(100)
    second = queue.ask(200)
    await queue.until_waiting(1)

    queue.harness.host.remove_container("kernel-100")  # the kernel exits, and its container
    await queue.harness.reconciler.run_once()

    assert [a["target"] for a in (await second)["attachments"]] == [{"pid": 200}]


async def test_waiter_whose_target_exits_leaves(queue: Queue) -> None:
    await queue.ask(100)
    gone = queue.ask(200)
    await queue.until_waiting(1)

    queue.harness.host.kill(200)

    with pytest.raises(NotFound, match="process"):
        await gone
    assert len(queue.harness.core.queue) == 0


async def test_a_waiter_whose_target_cannot_be_looked_up_waits_on(queue: Queue) -> None:
    """A recheck that cannot tell whether the target runs (a slow runtime or API server) is
    not an exit: the request keeps its place and is served when a GPU is freed."""
    await queue.ask(100)
    waiter = queue.ask(200)
    await queue.until_waiting(1)
    resolver = queue.harness.resolver
    resolver.unanswered = True
    asked = resolver.lookups
    await eventually(lambda: resolver.lookups >= asked + 3, "three rechecks unanswered")
    assert not waiter.done()
    assert await queue.positions(200) == [1]

    resolver.unanswered = False
    queue.harness.host.remove_container("kernel-100")
    await queue.harness.reconciler.run_once()

    assert [a["target"] for a in (await waiter)["attachments"]] == [{"pid": 200}]


async def test_a_retry_of_a_waiting_request_is_refused(queue: Queue) -> None:
    await queue.ask(100)
    queue.ask(200, request_id="retry-me")
    await queue.until_waiting(1)

    with pytest.raises(Busy, match="already waiting"):
        await queue.service.attach(ADMIN, waiting(200, request_id="retry-me"))
    assert len(queue.harness.core.queue) == 1


async def test_cancel_of_an_unknown_request(queue: Queue) -> None:
    with pytest.raises(NotFound, match="queued request"):
        await queue.service.cancel_queued(ADMIN, RequestId("nothing-waits"), PidRef(900))


async def test_a_request_that_does_not_wait_is_answered_at_once(queue: Queue) -> None:
    await queue.ask(100)
    queue.harness.host.spawn(200, "kernel-200")
    with pytest.raises(InsufficientGpus):
        await queue.service.attach(
            ADMIN, AttachRequest(count=1, target=PidRef(200), wait_seconds=60, request_id=None)
        )
    assert len(queue.harness.core.queue) == 0


async def test_a_waiting_request_counts_towards_its_targets_limit(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A request is admitted once, when it joins the queue; so what it waits for must count as
    # held, or a second request of the same target could pass the limit meanwhile.
    monkeypatch.setattr(
        queue.service, "_config", replace(queue.service._config, max_gpus_per_target=2)
    )
    await queue.ask(100)  # takes the one free GPU
    first = queue.ask(200, count=2)
    await queue.until_waiting(1)

    with pytest.raises(Forbidden) as caught:
        await queue.service.attach(ADMIN, waiting(200))
    assert caught.value.extra == {"limit": 2, "attached": 2, "requested": 1}
    assert len(queue.harness.core.queue) == 1
    assert not first.done()


async def test_a_retry_of_a_served_request_does_not_queue(queue: Queue) -> None:
    served = await queue.ask(100, request_id="once")
    queue.ask(200)
    await queue.until_waiting(1)

    again = await queue.service.attach(ADMIN, waiting(100, request_id="once"))

    assert again == served
    assert len(queue.harness.core.queue) == 1
