"""An attach that names its GPUs (``gpus``; issue 36, item 6): a GPU card's Attach attaches
that card's GPU, not any free one.

What must hold: exactly the named GPUs are reserved or nothing is; a named GPU held by someone
else is refused naming it by its index and its holder only as far as the caller may know it
(another tenant is "another container"); an unknown one is 404 ``gpu``; with ``wait_seconds``
the request waits for that GPU (other free GPUs do not serve it); where the cluster picks the
device (Kubernetes) a named GPU is refused before anything is asked of the allocator, and the
GPU list says so (``selectable``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PidRef, Target
from jupyter_gpu_hotplug.agent.core.errors import InsufficientGpus, InvalidRequest, NotFound
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest
from jupyter_gpu_hotplug.agent.core.workers import Workers
from tests.fixtures.waiting import eventually

from .fakes import MemoryAllocator
from .service_harness import ADMIN, Harness, build, device_plugin_allocator


def named(pid: int, *uuids: str, queued: bool = False) -> AttachRequest:
    return AttachRequest(
        count=len(uuids),
        target=PidRef(pid),
        wait_seconds=60.0,
        request_id=None,
        gpus=tuple(GpuUuid(uuid) for uuid in uuids),
        queued=queued,
    )


def uuid_of(harness: Harness, index: int) -> GpuUuid:
    return harness.inventory.gpus[index].uuid


async def test_the_named_gpu_is_the_one_attached(harness: Harness) -> None:
    harness.host.spawn(100, "kernel-a")

    result = await harness.service.attach(ADMIN, named(100, uuid_of(harness, 2)))

    assert [(a["uuid"], a["index"]) for a in result["attachments"]] == [(uuid_of(harness, 2), 2)]
    assert [e.gpu.index for e in harness.ledger.attachments()] == [2]
    listed = (await harness.service.gpus(ADMIN))["gpus"]
    assert [g["state"] for g in listed] == ["free", "free", "attached", "free"]
    assert all(g["selectable"] for g in listed)


async def test_several_named_gpus(harness: Harness) -> None:
    harness.host.spawn(100, "kernel-a")

    result = await harness.service.attach(
        ADMIN, named(100, uuid_of(harness, 3), uuid_of(harness, 1))
    )

    assert sorted(a["index"] for a in result["attachments"]) == [1, 3]


async def test_a_named_gpu_of_another_container_is_refused_naming_it(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness.host.spawn(100, "kernel-a")
    harness.host.spawn(200, "kernel-b")
    await harness.service.attach(ADMIN, named(100, uuid_of(harness, 1)))

    with pytest.raises(InsufficientGpus) as caught:
        await harness.service.attach(ADMIN, named(200, uuid_of(harness, 1)))

    assert caught.value.message.startswith(
        f"GPU 1 ({uuid_of(harness, 1)}) is attached to process 100"
    )
    assert caught.value.retryable
    assert "wait_seconds" in caught.value.message
    assert [str(e.target) for e in harness.ledger.attachments()] == ["process 100"]

    async def sees_nobody(caller: object, target: Target) -> bool:
        return False

    # Issue 31: a caller who may not see the holder learns only that the GPU is taken.
    monkeypatch.setattr(harness.identity, "may_see", sees_nobody)
    with pytest.raises(InsufficientGpus) as caught:
        await harness.service.attach(ADMIN, named(200, uuid_of(harness, 1)))
    assert "attached to another container" in caught.value.message
    assert "100" not in caught.value.message


async def test_a_named_gpu_the_target_has_is_refused_for_good(harness: Harness) -> None:
    harness.host.spawn(100, "kernel-a")
    await harness.service.attach(ADMIN, named(100, uuid_of(harness, 0)))

    # Even when it may wait: it would wait for itself.
    with pytest.raises(InsufficientGpus) as caught:
        await harness.service.attach(ADMIN, named(100, uuid_of(harness, 0), queued=True))

    assert "is already attached to process 100" in caught.value.message
    assert not caught.value.retryable
    assert len(harness.core.queue) == 0


async def test_an_unknown_gpu_is_not_found(harness: Harness) -> None:
    harness.host.spawn(100, "kernel-a")
    unknown = "GPU-deadbeef-0000-4000-8000-000000000000"

    with pytest.raises(NotFound) as caught:
        await harness.service.attach(ADMIN, named(100, uuid_of(harness, 0), unknown))

    assert (caught.value.resource, caught.value.name) == ("gpu", unknown)
    assert harness.ledger.attachments() == []


async def test_a_lost_gpu_is_not_found(harness: Harness) -> None:
    harness.host.spawn(100, "kernel-a")
    lost = uuid_of(harness, 3)
    harness.inventory.lose(3)

    with pytest.raises(NotFound) as caught:
        await harness.service.attach(ADMIN, named(100, lost))

    assert "1 GPU(s) of the node are lost" in caught.value.message


async def test_a_waiting_request_waits_for_its_named_gpu(harness: Harness) -> None:
    harness.host.spawn(100, "kernel-a")
    harness.host.spawn(200, "kernel-b")
    await harness.service.attach(ADMIN, named(100, uuid_of(harness, 2)))

    waiting = asyncio.ensure_future(
        harness.service.attach(ADMIN, named(200, uuid_of(harness, 2), queued=True))
    )
    await eventually(lambda: len(harness.core.queue) == 1, "the request waits in the queue")
    # Three other GPUs are free all along, and serve it not.
    assert not waiting.done()

    await harness.service.detach(ADMIN, uuid_of(harness, 2), force=False)
    result = await waiting

    assert [a["uuid"] for a in result["attachments"]] == [uuid_of(harness, 2)]
    assert [(str(e.target), e.gpu.index) for e in harness.ledger.attachments()] == [
        ("process 200", 2)
    ]


async def test_a_cluster_that_picks_the_device_refuses_named_gpus(
    tmp_path: Path, workers: Workers
) -> None:
    harness = await build(tmp_path, workers=workers, allocator="memory")
    try:
        assert isinstance(harness.allocator, MemoryAllocator)
        harness.allocator.selectable = False
        harness.host.spawn(100, "kernel-a")

        with pytest.raises(InvalidRequest) as caught:
            await harness.service.attach(ADMIN, named(100, uuid_of(harness, 1)))

        assert caught.value.field == "gpus"
        assert "the cluster picks the device" in caught.value.message
        assert harness.allocator.all_attachments() == []
        listed = (await harness.service.gpus(ADMIN))["gpus"]
        assert not any(g["selectable"] for g in listed)
        # The generic attach still works.
        await harness.service.attach(
            ADMIN, AttachRequest(count=1, target=PidRef(100), wait_seconds=60.0, request_id=None)
        )
    finally:
        harness.ledger.close()


async def test_the_kubernetes_allocator_is_refused_before_it_is_asked(harness: Harness) -> None:
    """Kubernetes mode: a holder pod asks for *a* GPU, and the device plugin picks which. The
    service refuses a named GPU before the allocator is used at all (this one has no API
    server, kubelet or pods: any use of them would fail otherwise)."""
    holders = device_plugin_allocator()
    assert not holders.selectable
    harness.core.allocator = holders
    harness.host.spawn(100, "kernel-a")

    with pytest.raises(InvalidRequest) as caught:
        await harness.service.attach(ADMIN, named(100, uuid_of(harness, 0)))

    assert caught.value.field == "gpus"
